"""What a stage knows about the tensors it exchanges: shape, stride, dtype, whether they need a gradient.

A receiving stage allocates its buffers from this metadata before the sender
has sent anything, so both sides must agree on it. It comes either from the
user (``input_args``/``output_args``: static) or from running the first
microbatch once and passing each stage's output metadata to the next stage
(dynamic), as PyTorch 2.13 does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PipeliningMetadataError", "TensorMeta", "metas_of", "normalize_tensors", "check_metas", "grad_metas"]


class PipeliningMetadataError(RuntimeError):
    """Tensor metadata of a stage is missing or disagrees with what its neighbour sends or expects."""


@dataclass(frozen=True)
class TensorMeta:
    """Enough to allocate a receive buffer: shape, stride and dtype (requires_grad rides along, unchecked)."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(tensor: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tensor.shape, tensor.stride(), tensor.dtype, tensor.requires_grad)

    def empty(self, device: torch.device | str) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)

    def differences(self, other: "TensorMeta") -> list[str]:
        out = []
        if self.shape != other.shape:
            out.append(f"shape mismatch: {self.shape} vs {other.shape}")
        if self.stride != other.stride:
            out.append(f"stride mismatch: {self.stride} vs {other.stride}")
        if self.dtype != other.dtype:
            out.append(f"dtype mismatch: {self.dtype} vs {other.dtype}")
        return out


def normalize_tensors(values: Any, what: str) -> tuple[torch.Tensor, ...] | None:
    """``values`` (a tensor, a tuple or list of tensors, or None) as a tuple, refusing anything else."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        return (values,)
    if not isinstance(values, (tuple, list)):
        raise PipeliningMetadataError(
            f"{what} must be a tensor, tuple, or list of tensors, got {type(values).__name__}."
        )
    for i, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            raise PipeliningMetadataError(
                f"{what}[{i}] has type {type(value).__name__}. All stage args must be tensors. "
                "Use kwargs for non-tensor inputs."
            )
    return tuple(values)


def metas_of(tensors: tuple[torch.Tensor, ...] | None) -> tuple[TensorMeta, ...] | None:
    return None if tensors is None else tuple(TensorMeta.of(t) for t in tensors)


def grad_metas(metas: tuple[TensorMeta, ...]) -> tuple[TensorMeta | None, ...]:
    """Metadata of the gradients of ``metas``: the same layout, None where no gradient flows."""
    return tuple(
        TensorMeta(m.shape, m.stride, m.dtype, False) if m.requires_grad else None for m in metas
    )


def check_metas(what: str, expected: tuple[TensorMeta, ...], actual: tuple[TensorMeta, ...]) -> None:
    """Raise PipeliningMetadataError naming ``what`` and each difference when the two disagree."""
    if len(expected) != len(actual):
        raise PipeliningMetadataError(f"{what}: expected {len(expected)} tensors, got {len(actual)}")
    for i, (want, got) in enumerate(zip(expected, actual)):
        diffs = want.differences(got)
        if diffs:
            raise PipeliningMetadataError(f"{what}[{i}]: {'; '.join(diffs)}")
