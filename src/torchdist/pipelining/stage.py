"""``PipelineStage``: one piece of the model, its place in the pipeline, and its forward and backward of a microbatch.

A stage runs its submodule on one microbatch at a time. It receives activations
from stage ``i - 1`` and sends its outputs to stage ``i + 1``; in backward it
receives the gradients of its outputs from ``i + 1`` and sends the gradients of
its inputs to ``i - 1``. Stage ``i`` lives on group rank ``i % group_size``
(looped placement) unless the schedule says otherwise (the V placement of
``ScheduleZBVZeroBubble``). Neighbours on the same rank hand tensors over
directly; others use ``_comm``.

Before the first step the stages agree on the tensors they exchange: a vote
runs from stage 0 to the last stage and back. If every stage was given
``input_args`` and ``output_args`` (static), those are used; otherwise
(dynamic) each stage runs the first microbatch once, under a forked RNG, and
passes its output metadata to the next stage. User-given metadata that
disagrees with its neighbour's raises :class:`PipeliningMetadataError`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .._c10d.init import get_rank, get_world_size
from .._process_group.process_group import ProcessGroup
from .._process_group.work import Work
from . import _comm
from ._meta import PipeliningMetadataError, TensorMeta, check_metas, grad_metas, metas_of, normalize_tensors

__all__ = ["PipelineStage", "build_stage"]

logger = logging.getLogger(__name__)

# Tags of the set-up messages (plus the sending stage's index).
_VOTE_TAG, _RESULT_TAG, _META_TAG = 0, 1 << 12, 2 << 12


def _as_tuple(output: Any) -> tuple:
    """A stage's output as a tuple of its values (a single tensor becomes a 1-tuple)."""
    if isinstance(output, (tuple, list)):
        return tuple(output)
    return (output,)


class PipelineStage:
    """A stage of a manually split pipeline: ``submodule`` is stage ``stage_index`` of ``num_stages``.

    ``input_args``/``output_args`` are example tensors (their values are unused)
    with the shapes of one microbatch's inputs and outputs; without them the
    shapes are inferred from the first microbatch.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_grads: Any = None,
        input_grads: Any = None,
        group: ProcessGroup | None = None,
        dw_builder: Callable[[], Callable[..., None]] | None = None,
        get_mesh: Any = None,
    ) -> None:
        if stage_index >= num_stages:
            raise ValueError(f"Stage index {stage_index} is out of range of {num_stages}")
        if stage_index < 0:
            raise ValueError(f"Stage index {stage_index} must not be negative")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        self.dw_builder = dw_builder
        self.group_rank = get_rank(group)
        self.group_size = get_world_size(group)
        if self.group_size > num_stages:
            raise RuntimeError(
                f"Pipeline group size {self.group_size} cannot be larger than number of stages {num_stages}"
            )
        self.stage_index_to_group_rank: dict[int, int] = {i: i % self.group_size for i in range(num_stages)}
        self.log_prefix = f"[Stage {stage_index}]"
        self.has_backward = False
        self.chunks: int | None = None
        self._user_inputs = metas_of(normalize_tensors(input_args, "input_args"))
        self._user_outputs = metas_of(normalize_tensors(output_args, "output_args"))
        # agreed metadata of the forward inputs and outputs (None until the first step sets them)
        self.inputs_meta: tuple[TensorMeta, ...] | None = None
        self.outputs_meta: tuple[TensorMeta, ...] | None = None
        self._static: bool | None = None
        self._prev_outputs: tuple[TensorMeta, ...] | None = None  # the previous stage's output_args, if given
        # per microbatch of the current step
        self.fwd_cache: dict[int, tuple[tuple, list[torch.Tensor]]] = {}
        self.bwd_cache: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self.backward_state: dict[int, tuple] = {}
        self.dw_runner: dict[int, Callable[[], None]] = {}
        self.output_chunks: list[Any] = []
        self._local_inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._local_grads: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self._recv_works: dict[tuple[int, int], tuple[list[Work], tuple]] = {}

    # -- place in the pipeline ----------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _rank_of(self, stage: int) -> int:
        return self.stage_index_to_group_rank[stage]

    def _is_local(self, stage: int) -> bool:
        return self._rank_of(stage) == self.group_rank

    def __repr__(self) -> str:
        return f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, rank={self.group_rank})"

    def _what(self, action: str, microbatch: int | None, peer_stage: int) -> Callable[[], str]:
        mb = "" if microbatch is None else f" of microbatch {microbatch}"
        return lambda: (f"pipeline stage {self.stage_index} (group rank {self.group_rank}): {action}{mb} "
                        f"with stage {peer_stage} on group rank {self._rank_of(peer_stage)} failed")

    # -- agreeing on metadata (first step) ----------------------------------------------------
    def _fingerprint(self, n_microbatches: int, has_backward: bool) -> tuple:
        return (self.num_stages, self.group_size, n_microbatches, has_backward)

    def _vote_forward(self, prev: Any, n_microbatches: int, has_backward: bool) -> Any:
        """Pass (all static so far, fingerprint, user output metadata) on towards the last stage."""
        fingerprint = self._fingerprint(n_microbatches, has_backward)
        if not self.is_first:
            if not self._is_local(self.stage_index - 1):
                prev = _comm.recv_object(self._rank_of(self.stage_index - 1), self.group,
                                         _VOTE_TAG + self.stage_index - 1,
                                         self._what("receiving the set-up vote", None, self.stage_index - 1))
            static, theirs, prev_outputs = prev
            if theirs != fingerprint:
                raise RuntimeError(
                    f"pipeline stage {self.stage_index}: stage {self.stage_index - 1} disagrees about the pipeline: "
                    f"(num_stages, group_size, n_microbatches, has_backward) is {theirs} there and {fingerprint} "
                    "here. Build every stage and schedule with the same arguments on every rank."
                )
            self._prev_outputs = prev_outputs
            if prev_outputs is not None and self._user_inputs is not None:
                check_metas(f"Stage {self.stage_index} input_args vs stage {self.stage_index - 1} output_args",
                            prev_outputs, self._user_inputs)
        else:
            static = True
        static = static and self._user_inputs is not None and self._user_outputs is not None
        vote = (static, fingerprint, self._user_outputs)
        if not self.is_last and not self._is_local(self.stage_index + 1):
            _comm.wait_all(_comm.send_object(vote, self._rank_of(self.stage_index + 1), self.group,
                                             _VOTE_TAG + self.stage_index),
                           self._what("sending the set-up vote", None, self.stage_index + 1))
        return vote

    def _vote_backward(self, result: Any) -> bool:
        """Bring the last stage's verdict (all static?) back to stage 0."""
        if not self.is_last and not self._is_local(self.stage_index + 1):
            result = _comm.recv_object(self._rank_of(self.stage_index + 1), self.group,
                                       _RESULT_TAG + self.stage_index + 1,
                                       self._what("receiving the set-up verdict", None, self.stage_index + 1))
        if not self.is_first and not self._is_local(self.stage_index - 1):
            _comm.wait_all(_comm.send_object(result, self._rank_of(self.stage_index - 1), self.group,
                                             _RESULT_TAG + self.stage_index),
                           self._what("sending the set-up verdict", None, self.stage_index - 1))
        self._static = bool(result)
        return result

    def _infer_forward_meta(self, prev: Any, args: tuple, kwargs: dict, has_backward: bool) -> Any:
        """Run microbatch 0 once to learn the output metadata; pass it on. ``prev``: a local neighbour's."""
        if self._static:
            self.inputs_meta, self.outputs_meta = self._user_inputs, self._user_outputs
            if self._prev_outputs is not None:  # a gradient flows back where the sender's output needs one
                self.inputs_meta = tuple(TensorMeta(m.shape, m.stride, m.dtype, p.requires_grad)
                                         for m, p in zip(self.inputs_meta, self._prev_outputs))
            return self.outputs_meta
        if self.is_first:
            inputs = normalize_tensors(args, f"Stage {self.stage_index} forward inputs")
            self.inputs_meta = metas_of(inputs)
            values = tuple(a.detach().requires_grad_(a.requires_grad) for a in inputs)
        else:
            if not self._is_local(self.stage_index - 1):
                prev = _comm.recv_object(self._rank_of(self.stage_index - 1), self.group,
                                         _META_TAG + self.stage_index - 1,
                                         self._what("receiving the activation metadata", 0, self.stage_index - 1))
            self.inputs_meta = prev
            values = tuple(m.empty(self.device).zero_().requires_grad_(m.requires_grad and m.dtype.is_floating_point)
                           for m in prev)
        if self._user_inputs is not None:
            check_metas(f"Stage {self.stage_index} input", self._user_inputs, self.inputs_meta)
        with torch.random.fork_rng(devices=[]), (torch.enable_grad() if has_backward else torch.no_grad()):
            outputs = self.submod(*values, **(kwargs or {}))
        outputs = normalize_tensors(outputs, f"Stage {self.stage_index} output")
        self.outputs_meta = metas_of(outputs)
        if self._user_outputs is not None:
            check_metas(f"Stage {self.stage_index} output", self._user_outputs, self.outputs_meta)
        if not self.is_last and not self._is_local(self.stage_index + 1):
            _comm.wait_all(_comm.send_object(self.outputs_meta, self._rank_of(self.stage_index + 1), self.group,
                                             _META_TAG + self.stage_index),
                           self._what("sending the activation metadata", 0, self.stage_index + 1))
        return self.outputs_meta

    # -- runtime state ------------------------------------------------------------------------
    def clear_runtime_states(self) -> None:
        """Forget the microbatches of the previous step."""
        self.fwd_cache.clear()
        self.bwd_cache.clear()
        self.backward_state.clear()
        self.dw_runner.clear()
        self.output_chunks.clear()
        self._local_inputs.clear()
        self._local_grads.clear()
        self._recv_works.clear()

    def _check_chunk_id(self, chunk_id: int) -> None:
        if self.chunks is None:
            raise RuntimeError("Attempted to access chunk_id before chunks have been configured.")
        if chunk_id >= self.chunks:
            raise RuntimeError(f"Chunk id {chunk_id} is out of range [0, {self.chunks})")

    # -- receiving ---------------------------------------------------------------------------
    def post_fwd_recv(self, mb: int) -> None:
        """Start receiving microbatch ``mb``'s activations from the previous stage (if it is on another rank)."""
        if self.is_first or self._is_local(self.stage_index - 1) or (0, mb) in self._recv_works:
            return
        if self.inputs_meta is None:
            raise PipeliningMetadataError(f"Stage {self.stage_index}: inputs metadata required for recv info.")
        buffers = tuple(m.empty(self.device) for m in self.inputs_meta)
        works = _comm.recv_tensors(list(enumerate(buffers)), self._rank_of(self.stage_index - 1), self.group,
                                   _comm.FORWARD, self.stage_index - 1, mb, self.num_stages)
        self._recv_works[(0, mb)] = (works, buffers)

    def post_bwd_recv(self, mb: int) -> None:
        """Start receiving the gradients of microbatch ``mb``'s outputs from the next stage (another rank)."""
        if self.is_last or self._is_local(self.stage_index + 1) or (1, mb) in self._recv_works:
            return
        metas = grad_metas(self.outputs_meta)
        buffers = tuple(None if m is None else m.empty(self.device) for m in metas)
        works = _comm.recv_tensors([(i, b) for i, b in enumerate(buffers) if b is not None],
                                   self._rank_of(self.stage_index + 1), self.group,
                                   _comm.BACKWARD, self.stage_index + 1, mb, self.num_stages)
        self._recv_works[(1, mb)] = (works, buffers)

    def _received(self, direction: int, mb: int) -> tuple:
        self.post_fwd_recv(mb) if direction == 0 else self.post_bwd_recv(mb)
        works, buffers = self._recv_works.pop((direction, mb))
        peer = self.stage_index - 1 if direction == 0 else self.stage_index + 1
        what = "receiving the activations" if direction == 0 else "receiving the output gradients"
        _comm.wait_all(works, self._what(what, mb, peer))
        return buffers

    def _forward_inputs(self, mb: int, args: tuple) -> tuple:
        if self.is_first:
            return args
        if self._is_local(self.stage_index - 1):
            received = self._local_inputs.pop(mb)
        else:
            received = self._received(0, mb)
        want_grad = self.has_backward and torch.is_grad_enabled()
        return tuple(t.detach().requires_grad_(want_grad and m.requires_grad and t.dtype.is_floating_point)
                     for t, m in zip(received, self.inputs_meta))

    def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
        """Take the previous stage's outputs directly (it runs on this rank)."""
        self._local_inputs[mb_index] = tuple(t.detach() for t in _as_tuple(prev_stage_outputs))

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
        """Take the next stage's input gradients directly (it runs on this rank)."""
        self._local_grads[mb_index] = next_stage_bwd_outputs

    def get_local_bwd_output(self, mb_index: int) -> tuple:
        self._check_chunk_id(mb_index)
        return self.bwd_cache.pop(mb_index)

    # -- compute ------------------------------------------------------------------------------
    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True) -> Any:
        """Run microbatch ``fwd_chunk_id`` forward; keep what backward needs; return the submodule's output."""
        inputs = self._forward_inputs(fwd_chunk_id, args)
        kwargs = kwargs or {}
        try:
            output = self.submod(*inputs, **kwargs)
        except Exception as exc:
            shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in inputs]
            raise RuntimeError(f"{self.log_prefix} failed to run forward of microbatch {fwd_chunk_id} "
                               f"with inputs of shapes {shapes}: {exc}") from exc
        outputs = _as_tuple(output)
        if not self.is_last and self.outputs_meta is not None:
            got = tuple(TensorMeta.of(t) if isinstance(t, torch.Tensor) else None for t in outputs)
            if None in got:
                raise PipeliningMetadataError(
                    f"Stage {self.stage_index}: forward of microbatch {fwd_chunk_id} returned a non-tensor "
                    "output; only tensors can be sent to the next stage"
                )
            check_metas(f"Stage {self.stage_index} forward outputs of microbatch {fwd_chunk_id}",
                        self.outputs_meta, got)
        if self.is_last and save_forward_output:
            self.output_chunks.append(output)
        flat_inputs = [t for t in tree_flatten((inputs, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.fwd_cache[fwd_chunk_id] = (outputs, flat_inputs)
        return output

    def send_forward(self, mb: int, next_stage: "PipelineStage | None") -> list[Work]:
        """Hand microbatch ``mb``'s outputs to the next stage: directly if local, else by isend."""
        if self.is_last:
            return []
        outputs = self.fwd_cache[mb][0]
        if next_stage is not None:
            next_stage.set_local_fwd_input(outputs, mb)
            return []
        return _comm.send_tensors(list(enumerate(outputs)), self._rank_of(self.stage_index + 1), self.group,
                                  _comm.FORWARD, self.stage_index, mb, self.num_stages)

    def _output_grads(self, mb: int) -> tuple:
        if self._is_local(self.stage_index + 1):
            return self._local_grads.pop(mb)
        return self._received(1, mb)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: torch.Tensor | None = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        """Backward of microbatch ``bwd_chunk_id``: from ``loss`` on the last stage, else from the gradients
        the next stage sent. ``full_backward=False``: input gradients only; the weights wait for
        ``backward_weight_one_chunk``."""
        if not self.has_backward:
            return
        self._check_chunk_id(bwd_chunk_id)
        outputs, inputs = self.fwd_cache.pop(bwd_chunk_id)
        if self.is_last:
            if loss is None:
                raise RuntimeError(f"{self.log_prefix} backward of microbatch {bwd_chunk_id} needs the loss")
            roots, grads = [loss], [None]
        else:
            output_grads = self._output_grads(bwd_chunk_id)
            pairs = [(o, g) for o, g in zip(outputs, output_grads)
                     if isinstance(o, torch.Tensor) and o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        leaves = [t for t in inputs if t.requires_grad]
        if full_backward or self.dw_builder is not None:
            if roots:
                torch.autograd.backward(roots, grad_tensors=grads)
            input_grads = tuple(t.grad if t.requires_grad else None for t in inputs)
            if self.dw_builder is not None:
                if full_backward:
                    self.dw_builder()()
                else:
                    self.dw_runner[bwd_chunk_id] = self.dw_builder()
        else:
            # input gradients now, keeping the graph for the weight gradients later (zero-bubble schedules)
            input_grads = tuple(None for _ in inputs)
            if leaves and roots and not self.is_first:
                got = torch.autograd.grad(roots, leaves, grad_outputs=grads, retain_graph=True, allow_unused=True)
                by_id = {id(t): g for t, g in zip(leaves, got)}
                input_grads = tuple(by_id.get(id(t)) for t in inputs)
            self.backward_state[bwd_chunk_id] = (roots, grads)
            self.dw_runner[bwd_chunk_id] = lambda: None
        n_args = len(self.inputs_meta) if self.inputs_meta is not None else len(input_grads)
        self.bwd_cache[bwd_chunk_id] = input_grads[:n_args]
        if self.is_last and not self.is_first and (full_backward or self.dw_builder is not None):
            for t in outputs:  # the graph is gone; the outputs only serve the merged result now
                if isinstance(t, torch.Tensor) and not t._is_view():
                    t.detach_()

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """The weight gradients of a microbatch whose input gradients ``backward_one_chunk(full_backward=False)``
        already computed."""
        if not self.has_backward:
            return
        if bwd_chunk_id not in self.dw_runner:
            raise RuntimeError(
                f"{self.log_prefix} Attempted to run backward_weight_one_chunk for chunk {bwd_chunk_id} without "
                "first calling `backward_one_chunk(full_backward=False)`"
            )
        runner = self.dw_runner.pop(bwd_chunk_id)
        if self.dw_builder is not None:
            runner()
            return
        roots, grads = self.backward_state.pop(bwd_chunk_id)
        if not roots:
            return
        if self.is_first:  # B computed nothing here: run the whole backward (user inputs get their .grad too)
            torch.autograd.backward(roots, grad_tensors=grads)
            return
        params = [p for p in self.submod.parameters() if p.requires_grad]
        if params:
            torch.autograd.backward(roots, grad_tensors=grads, inputs=params)

    def send_backward(self, mb: int, prev_stage: "PipelineStage | None") -> list[Work]:
        """Hand microbatch ``mb``'s input gradients to the previous stage: directly if local, else by isend.
        Inputs that needed a gradient but got none send zeros, so that the receiver is never left waiting."""
        if self.is_first or not self.has_backward:
            return []
        grads = self.bwd_cache.pop(mb)
        if prev_stage is not None:
            prev_stage.set_local_bwd_input(grads, mb)
            return []
        to_send = []
        for i, (grad, meta) in enumerate(zip(grads, grad_metas(self.inputs_meta))):
            if meta is None:
                continue
            to_send.append((i, grad if grad is not None else meta.empty(self.device).zero_()))
        return _comm.send_tensors(to_send, self._rank_of(self.stage_index - 1), self.group,
                                  _comm.BACKWARD, self.stage_index, mb, self.num_stages)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide the submodule's gradients by ``grad_scale_factor`` (the number of microbatches for a
        mean-reducing loss, 1 for a summing one)."""
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self.scale_grads(grad_scale_factor)


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info: Any, device: torch.device | str,
                group: ProcessGroup | None = None) -> PipelineStage:
    """A stage of a traced pipeline (see ``pipeline``), with the metadata the trace recorded."""
    inputs, outputs = pipe_info.stage_examples[stage_index]
    return PipelineStage(stage_module, stage_index, pipe_info.num_stages, device,
                         input_args=inputs, output_args=outputs, group=group)
