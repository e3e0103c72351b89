"""Ring attention: one rank's query shard against the whole sequence's keys and values.

Ring attention (Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
2023) splits the sequence over ``W`` ranks. Rank ``r`` holds query, key and value shards; in ``W`` steps it sees
every rank's K/V block (step ``i``: the block of rank ``(r - i) mod W``), attends its queries to it and merges the
partial result with the online-softmax rule (Milakov and Gimelshein, 2018; FlashAttention, Dao et al., 2022):
a partial result is an output ``O`` normalised over its keys and the log-sum-exp ``L`` of its scores, and

    L = logaddexp(L1, L2),   O = exp(L1 - L) O1 + exp(L2 - L) O2

is exactly the attention over the union of the keys. Two ways to move K/V (``_RotateMethod``):

* all-gather: one ``all_gather_single`` of K|V (its backward a ``reduce_scatter_single``), then the blocks are
  attended locally; autograd differentiates the blockwise math. ``(W - 1) / W`` of K/V received in one step.
* all-to-all (neighbour passing): each step sends the held K/V block to rank ``r + 1`` and receives the next from
  ``r - 1`` while attending the current one; ``W - 1`` steps of one block each. Its backward (:class:`_RingAttention`)
  recomputes each block's probabilities from the saved global ``L``, and the block's dK/dV accumulator travels the
  ring with it: after ``W`` steps every accumulator is one hop from its owner, and one more exchange brings it home.

Causal masking works on chunks of the global sequence (see ``_load_balance``): a rank holds chunk ``r``, or
chunks ``r`` and ``2W - 1 - r`` when load balanced. A (query chunk, key chunk) pair is fully visible when the key
chunk comes first, uses the causal (top-left) mask when it is the same chunk, and is skipped when it comes after.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ...._c10d.collectives import all_gather_single, reduce_scatter_single
from ...._c10d.p2p import P2POp, batch_isend_irecv, irecv, isend

# Tags of the neighbour exchanges: K/V blocks and dK/dV accumulators travel the same links, kept apart.
_KV_TAG = 71
_DKV_TAG = 72


class _Visibility(enum.Enum):
    FULL = "full"
    DIAGONAL = "diagonal"
    SKIP = "skip"


@dataclass(frozen=True)
class _Layout:
    """Which chunks of the global sequence a rank holds, and how chunks see each other."""

    rank: int
    world: int
    balanced: bool
    is_causal: bool
    scale: float

    def split(self, x: torch.Tensor, owner: int) -> list[tuple[int, torch.Tensor]]:
        """``x`` (a shard of ``owner``, sequence on dim 2) as (chunk id, view) pairs."""
        if self.is_causal and self.balanced:
            head, tail = x.chunk(2, dim=2)
            return [(owner, head), (2 * self.world - 1 - owner, tail)]
        return [(owner, x)]

    def visibility(self, q_chunk: int, k_chunk: int) -> _Visibility:
        if not self.is_causal or k_chunk < q_chunk:
            return _Visibility.FULL
        return _Visibility.DIAGONAL if k_chunk == q_chunk else _Visibility.SKIP


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diagonal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the keys ``k``: the normalised output and the log-sum-exp of the scores."""
    s = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None,
           new: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial attentions over disjoint key sets."""
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1), lse


def _attend_block(layout: _Layout, q_parts: list[tuple[int, torch.Tensor]], accs: list, k: torch.Tensor,
                  v: torch.Tensor, src: int) -> list:
    """Merge the K/V block of rank ``src`` into the accumulators of each query chunk."""
    k_parts, v_parts = layout.split(k, src), layout.split(v, src)
    merged = []
    for (qa, q), acc in zip(q_parts, accs):
        seen = [layout.visibility(qa, kb) for kb, _ in k_parts]
        full = [j for j, s in enumerate(seen) if s is _Visibility.FULL]
        if full:
            kf = torch.cat([k_parts[j][1] for j in full], dim=2) if len(full) > 1 else k_parts[full[0]][1]
            vf = torch.cat([v_parts[j][1] for j in full], dim=2) if len(full) > 1 else v_parts[full[0]][1]
            acc = _merge(acc, _attend(q, kf, vf, layout.scale, diagonal=False))
        for j, s in enumerate(seen):
            if s is _Visibility.DIAGONAL:
                acc = _merge(acc, _attend(q, k_parts[j][1], v_parts[j][1], layout.scale, diagonal=True))
        merged.append(acc)
    return merged


def _finish(accs: list) -> tuple[torch.Tensor, torch.Tensor]:
    if any(a is None for a in accs):  # every query chunk sees at least its own diagonal block
        raise AssertionError("ring attention: a query chunk attended to no key")
    return torch.cat([a[0] for a in accs], dim=2), torch.cat([a[1] for a in accs], dim=2)


# -- all-gather ---------------------------------------------------------------------------------------------------


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (rank order); backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, world: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.world = group, world
        moved = x.movedim(2, 0).contiguous()
        out = moved.new_empty((world * moved.size(0), *moved.shape[1:]))
        all_gather_single(out, moved, group=group)
        return out.movedim(0, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        moved = grad.movedim(2, 0).contiguous()
        out = moved.new_empty((moved.size(0) // ctx.world, *moved.shape[1:]))
        reduce_scatter_single(out, moved, group=ctx.group)
        return out.movedim(0, 2), None, None


def _allgather_attention(layout: _Layout, group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         acc_dtype: torch.dtype) -> torch.Tensor:
    dk = k.size(-1)
    kv = torch.cat([k, v], dim=-1)
    if layout.world > 1:
        kv = _AllGatherSeq.apply(kv, group, layout.world)
    kv = kv.to(acc_dtype)
    block = k.size(2)
    q_parts = layout.split(q.to(acc_dtype), layout.rank)
    accs: list = [None] * len(q_parts)
    for i in range(layout.world):
        src = (layout.rank - i) % layout.world
        kv_src = kv.narrow(2, src * block, block)
        accs = _attend_block(layout, q_parts, accs, kv_src[..., :dk], kv_src[..., dk:], src)
    return _finish(accs)[0].to(q.dtype)


# -- neighbour passing ----------------------------------------------------------------------------------------------


def _exchange(send: torch.Tensor, group, layout: _Layout, tag: int) -> tuple[list, torch.Tensor]:
    """Start sending ``send`` to rank + 1 and receiving the same size from rank - 1."""
    recv = torch.empty_like(send)
    ops = [P2POp(isend, send, group=group, tag=tag, group_peer=(layout.rank + 1) % layout.world),
           P2POp(irecv, recv, group=group, tag=tag, group_peer=(layout.rank - 1) % layout.world)]
    return batch_isend_irecv(ops), recv


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _unpack(flat: torch.Tensor, k_shape: torch.Size, v_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return flat[:n].view(k_shape), flat[n:].view(v_shape)


class _RingAttention(torch.autograd.Function):
    """Ring attention with neighbour passing, forward and backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: _Layout, group,  # type: ignore
                acc_dtype: torch.dtype) -> torch.Tensor:
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        q_parts = layout.split(q.to(acc_dtype), layout.rank)
        accs: list = [None] * len(q_parts)
        for i in range(layout.world):
            src = (layout.rank - i) % layout.world
            works, nxt = _exchange(kv, group, layout, _KV_TAG) if i < layout.world - 1 else ([], kv)
            k_i, v_i = _unpack(kv.to(acc_dtype), k.shape, v.shape)
            accs = _attend_block(layout, q_parts, accs, k_i, v_i, src)
            _wait(works)
            kv = nxt
        out, lse = _finish(accs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.acc_dtype = layout, group, acc_dtype
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        layout, group, acc = ctx.layout, ctx.group, ctx.acc_dtype
        dout = grad_out.to(acc)
        delta = (dout * out).sum(-1)  # D = rowsum(dO * O), the softmax backward's correction term
        qf = q.to(acc)
        dq = torch.zeros_like(qf)
        q_parts = layout.split(qf, layout.rank)
        rows = [layout.split(t, layout.rank) for t in (dq, dout, lse.unsqueeze(-1), delta.unsqueeze(-1))]
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        dkv = torch.zeros(kv.numel(), dtype=acc, device=kv.device)
        for i in range(layout.world):
            src = (layout.rank - i) % layout.world
            works, nxt = _exchange(kv, group, layout, _KV_TAG) if i < layout.world - 1 else ([], kv)
            k_i, v_i = _unpack(kv.to(acc), k.shape, v.shape)
            dk_i, dv_i = _unpack(dkv, k.shape, v.shape)
            k_parts, v_parts = layout.split(k_i, src), layout.split(v_i, src)
            dk_parts, dv_parts = layout.split(dk_i, src), layout.split(dv_i, src)
            for a, (qa, qt) in enumerate(q_parts):
                dq_a, dout_a, lse_a, delta_a = (r[a][1] for r in rows)
                for b, (kb, kt) in enumerate(k_parts):
                    seen = layout.visibility(qa, kb)
                    if seen is _Visibility.SKIP:
                        continue
                    s = _scores(qt, kt, layout.scale, seen is _Visibility.DIAGONAL)
                    p = torch.exp(s - lse_a)
                    dv_parts[b][1].add_(torch.matmul(p.transpose(-2, -1), dout_a))
                    ds = p * (torch.matmul(dout_a, v_parts[b][1].transpose(-2, -1)) - delta_a)
                    dq_a.add_(torch.matmul(ds, kt), alpha=layout.scale)
                    dk_parts[b][1].add_(torch.matmul(ds.transpose(-2, -1), qt), alpha=layout.scale)
            _wait(works)
            kv = nxt
            if layout.world > 1:  # the accumulator follows its block to rank + 1; after W steps it is home
                works, dkv_next = _exchange(dkv, group, layout, _DKV_TAG)
                _wait(works)
                dkv = dkv_next
        dk, dv = _unpack(dkv, k.shape, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, *, rank: int, world: int,
                   is_causal: bool, scale: float, balanced: bool, all_gather: bool,
                   convert_to_f32: bool = True) -> torch.Tensor:
    """Attention of this rank's ``query`` shard (B, H, S/W, D) over the keys/values of every rank of ``group``."""
    layout = _Layout(rank, world, balanced, is_causal, scale)
    acc_dtype = torch.promote_types(query.dtype, torch.float32) if convert_to_f32 else query.dtype
    key, value = key.contiguous(), value.contiguous()
    if all_gather:
        return _allgather_attention(layout, group, query, key, value, acc_dtype)
    return _RingAttention.apply(query, key, value, layout, group, acc_dtype)
