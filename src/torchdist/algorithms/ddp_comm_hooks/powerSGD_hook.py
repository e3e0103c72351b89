"""PowerSGD gradient compression as a DDP communication hook.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization" (NeurIPS 2019), Algorithm 1: each
gradient matrix M (n x m) is approximated by P Q^T of rank r, found by one step
of power iteration per training step, warm-started from the previous step's Q:

    P = M Q          all-reduce P, orthogonalize P
    Q = M^T P        all-reduce Q, divide by the world size
    M ~ P Q^T        the error M - P Q^T is added to the next step's gradient

The bytes on the wire fall from n*m to (n+m)*r per matrix. Vectors (biases) and
matrices that would not shrink by ``min_compression_rate`` are all-reduced
uncompressed. Before ``start_powerSGD_iter`` the hook is a plain all-reduce,
which lets training settle before compression starts (section 4 of the paper).

The hooks issue their collectives themselves, on the thread that runs the hook,
and wait there for the all-reduced P (a small tensor) before computing Q. PyTorch's
hooks issue the next collective from the previous one's future callback instead,
which races the next bucket's hook on the main thread: ranks then issue the two in
different orders, and gloo hangs or pairs different collectives (measured: 4 runs
of 4 with two buckets). Issued in the hook, the order is the same on every rank.
Only the decompression runs in a future callback, and it issues nothing.
``batched_powerSGD_hook`` treats the whole bucket as one square matrix: fewer,
larger operations, lower accuracy.
"""

import logging
import math
from collections import defaultdict

import numpy as np
import torch

from ..._c10d.collectives import all_reduce
from ..._c10d.world import WORLD
from ..._ddp.bucket import GradBucket
from .default_hooks import _allreduce_fut

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"]

logger = logging.getLogger(__name__)


def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """Orthonormalize the columns of each matrix in the batch ``matrices`` (b x n x r), in place."""
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):  # Gram-Schmidt
            col = matrices[:, :, i:i + 1]
            col /= torch.norm(col, dim=1, keepdim=True) + epsilon
            if i + 1 < rank:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        q, _ = torch.linalg.qr(matrices)
        matrices.copy_(q)


def _should_compress(num_rows: int, num_cols: int, rank: int, min_compression_rate: float) -> tuple[bool, int, int]:
    uncompressed = num_rows * num_cols
    compressed = (num_rows + num_cols) * rank
    return compressed * min_compression_rate < uncompressed, uncompressed, compressed


def _sum_in_place_async(tensor: torch.Tensor, group) -> torch.futures.Future:
    """Sum ``tensor`` across ``group`` in place (``_allreduce_fut`` averages it)."""
    return all_reduce(tensor, group=group, async_op=True).get_future()


class PowerSGDState:
    """PowerSGD's settings and its per-bucket memory (error feedback, warm-start P and Q).

    Picklable without its process group, which becomes the default group on unpickling.
    """

    __slots__ = [
        "process_group", "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
        "use_error_feedback", "warm_start", "orthogonalization_epsilon", "rng", "error_dict", "p_memory_dict",
        "q_memory_dict", "iter", "total_numel_before_compression", "total_numel_after_compression",
        "compression_stats_logging_frequency", "next_stats_report", "batch_tensors_with_same_shape",
    ]

    def __init__(self, process_group, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000, batch_tensors_with_same_shape: bool = False):
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, because "
                "PowerSGD can only be applied after the first two iterations in DDP.")
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        # Same seed on every rank: same random Q everywhere. numpy's generator, as PyTorch's,
        # so that the same seed draws the same Qs as PyTorch's hook (and state.rng works alike).
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape

    def __getstate__(self) -> dict:
        logger.warning("NOTE: Process group is not serializable and excluded from a saved state.")
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state: dict) -> None:
        self.process_group = WORLD.require_default()
        logger.warning("NOTE: Process group will be set to a default group (i.e. the world size). If a different "
                       "group is desired, please set `self.process_group` after PowerSGD state is loaded.")
        for slot, value in state.items():
            setattr(self, slot, value)

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before compression, elements after), over all iterations so far."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after

    def _random_seed(self) -> int:
        return int(self.rng.randint(1_000_000_000))

    def _report(self, bucket: GradBucket) -> None:
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info("Compression stats: iter %s, total before compression %s, total after compression %s, "
                        "rate %s", self.iter, before, after, rate)
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency


def _group(state: PowerSGDState):
    return state.process_group if state.process_group is not None else WORLD.require_default()


def _apply_error_feedback(state: PowerSGDState, index: int, tensor: torch.Tensor) -> torch.Tensor | None:
    if not state.use_error_feedback:
        return None
    if index in state.error_dict:
        tensor.add_(state.error_dict[index])
    else:
        logger.info("A zero tensor of length %s that represents local error is created.", tensor.numel())
        state.error_dict[index] = torch.zeros_like(tensor)
    return tensor.detach().clone()


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress each gradient matrix of the bucket to rank ``state.matrix_approximation_rank``."""
    group = _group(state)
    world_size = group.size()
    input_tensor = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_fut(group, input_tensor)
    index = bucket.index()
    dtype = input_tensor.dtype
    input_copy = _apply_error_feedback(state, index, input_tensor)

    to_compress, uncompressed = [], []
    total_p = total_q = 0
    for tensor in bucket.gradients():
        matrix = tensor.view(tensor.shape[0], -1) if tensor.dim() > 0 else tensor.view(1, 1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        compress, before, after = _should_compress(n, m, r, state.min_compression_rate)
        state.total_numel_before_compression += before
        if compress:
            to_compress.append(matrix)
            total_p += n * r
            total_q += m * r
            state.total_numel_after_compression += after
        else:
            uncompressed.append(tensor)
            state.total_numel_after_compression += before
    state._report(bucket)
    flat_uncompressed = (torch.cat([t.reshape(-1) for t in uncompressed]) if uncompressed
                         else torch.tensor([], dtype=dtype))

    randomize = not state.warm_start or index not in state.p_memory_dict
    # Held here, not looked up again: without warm start, an earlier bucket's decompress
    # (a future callback, maybe on another thread) clears the dicts while this hook runs.
    if randomize:
        p_memory, q_memory = torch.empty(total_p, dtype=dtype), torch.empty(total_q, dtype=dtype)
        state.p_memory_dict[index], state.q_memory_dict[index] = p_memory, q_memory
    else:
        p_memory, q_memory = state.p_memory_dict[index], state.q_memory_dict[index]

    by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
    for matrix in to_compress:
        by_shape[matrix.shape].append(matrix)
    batches: list[torch.Tensor] = []
    for same in by_shape.values():
        if state.batch_tensors_with_same_shape and len(same) > 1:
            batches.append(torch.stack(same))
        else:
            batches.extend(m.unsqueeze(0) for m in same)
    ps, qs = [], []
    p_at = q_at = 0
    for batch in batches:
        b, n, m = batch.shape
        r = min(n, m, state.matrix_approximation_rank)
        ps.append(p_memory[p_at:p_at + b * n * r].view(b, n, r))
        qs.append(q_memory[q_at:q_at + b * m * r].view(b, m, r))
        p_at += b * n * r
        q_at += b * m * r
    if randomize:
        generator = torch.Generator().manual_seed(state._random_seed())
        for q in qs:
            q.copy_(torch.randn(q.shape, generator=generator, dtype=dtype))
            _orthogonalize(q, state.orthogonalization_epsilon)
    else:
        for q in qs:
            _orthogonalize(q, state.orthogonalization_epsilon)
    for batch, q, p in zip(batches, qs, ps):
        torch.bmm(batch, q, out=p)

    # The uncompressed tensors and P go out together; Q needs the reduced P.
    uncompressed_fut = _sum_in_place_async(flat_uncompressed, group)
    _sum_in_place_async(p_memory, group).wait()
    for p in ps:
        _orthogonalize(p, state.orthogonalization_epsilon)
    for batch, p, q in zip(batches, ps, qs):
        torch.bmm(batch.transpose(1, 2), p, out=q)
    q_fut = _sum_in_place_async(q_memory, group)

    def decompress(_) -> torch.Tensor:
        reduced = uncompressed_fut.value()[0].div_(world_size)
        at = 0
        for tensor in uncompressed:
            tensor.copy_(reduced[at:at + tensor.numel()].view_as(tensor))
            at += tensor.numel()
        q_memory.div_(world_size)
        for p, q, batch in zip(ps, qs, batches):
            torch.bmm(p, q.transpose(1, 2), out=batch)
        if state.batch_tensors_with_same_shape:
            for batch in batches:
                if batch.shape[0] > 1:
                    for i, original in enumerate(by_shape[batch.shape[1:]]):
                        original.copy_(batch[i])
        if input_copy is not None:
            state.error_dict[index] = input_copy - input_tensor
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return input_tensor

    return torch.futures.collect_all([uncompressed_fut, q_fut]).then(decompress)


def batched_powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress the whole bucket, zero-padded to a square matrix, to rank ``matrix_approximation_rank``."""
    group = _group(state)
    world_size = group.size()
    input_tensor = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_fut(group, input_tensor)
    index = bucket.index()
    total = input_tensor.numel()
    side = math.ceil(math.sqrt(total))
    r = min(side, state.matrix_approximation_rank)
    state.total_numel_before_compression += total  # PyTorch's counts: the bucket, not the padded square
    state.total_numel_after_compression += side * state.matrix_approximation_rank * 2
    state._report(bucket)
    padded = torch.zeros(side * side, dtype=input_tensor.dtype)
    padded[:total].copy_(input_tensor)
    padded_copy = _apply_error_feedback(state, index, padded)
    matrix = padded.view(side, side)
    if not state.warm_start or index not in state.p_memory_dict:
        # Held here, not read back (see powerSGD_hook).
        generator = torch.Generator().manual_seed(state._random_seed())
        p = torch.empty(side, r, dtype=input_tensor.dtype)
        q = torch.randn(side, r, generator=generator, dtype=input_tensor.dtype)
        state.p_memory_dict[index], state.q_memory_dict[index] = p, q
    else:
        p, q = state.p_memory_dict[index], state.q_memory_dict[index]
    _orthogonalize(q.unsqueeze(0), state.orthogonalization_epsilon)
    torch.matmul(matrix, q, out=p)
    _sum_in_place_async(p, group).wait()  # Q needs the reduced P (see the module docstring)
    _orthogonalize(p.unsqueeze(0), state.orthogonalization_epsilon)
    torch.matmul(matrix.t(), p, out=q)

    def decompress(_) -> torch.Tensor:
        q.div_(world_size)
        torch.matmul(p, q.t(), out=matrix)
        if padded_copy is not None:
            state.error_dict[index] = padded_copy - padded
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        input_tensor.copy_(padded[:total])
        state.maybe_increase_iter(bucket)
        return input_tensor

    return _sum_in_place_async(q, group).then(decompress)
