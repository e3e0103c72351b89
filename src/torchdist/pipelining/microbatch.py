"""Splitting a batch into microbatches and merging the microbatch outputs back.

A chunk spec says, per argument, how it is split: ``TensorChunkSpec(dim)``
splits a tensor along ``dim`` (``torch.tensor_split``: sizes differ by at most
one), ``_Replicate`` hands the same value to every microbatch. Arguments are
nested (tuples, lists, dicts): specs mirror their structure, and the default is
dim 0 for tensors and replication for everything else. When a tensor is
shorter than the requested number of chunks, every argument is split into that
fewer number instead (the schedule then refuses the batch).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks"]

DEFAULT_CHUNK_DIM = 0


class TensorChunkSpec:
    """Split (or merge) a tensor argument along ``split_dim``."""

    split_dim: int

    def __init__(self, split_dim: int) -> None:
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"{self.__class__.__module__}.{self.__class__.__name__}({self.split_dim})"

    def __str__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    @staticmethod
    def from_tuple(chunk_dims: tuple[int, ...]):
        """A tuple of specs from a tuple of dims: ``from_tuple((0, 0, 1))``."""
        return tree_map(TensorChunkSpec, chunk_dims)

    @staticmethod
    def from_dict(chunk_dims: dict[str, int]):
        """A dict of specs from a dict of dims: ``from_dict({"ids": 0, "mask": 1})``."""
        return tree_map(TensorChunkSpec, chunk_dims)


class _Replicate:
    """Spec of an argument that every microbatch receives whole."""


class _CustomReducer:
    """Merge spec that folds the chunks with ``reduce_fn``, starting from ``init_value``."""

    def __init__(self, init_value: Any, reduce_fn: Callable[[Any, Any], Any]) -> None:
        self.init_value = init_value
        self.reduce_fn = reduce_fn


class _LossReducer(_CustomReducer):
    pass


sum_reducer = _LossReducer(torch.tensor(0.0), lambda a, b: a + b)

_TARGET_CHUNK_SPEC = TensorChunkSpec(DEFAULT_CHUNK_DIM)


def _is_replicate(spec: Any) -> bool:
    return spec is _Replicate or isinstance(spec, _Replicate)


def _split_tensor(tensor: torch.Tensor, spec: TensorChunkSpec, num_chunks: int) -> Sequence[torch.Tensor]:
    """``tensor`` cut into ``num_chunks`` pieces along ``spec.split_dim``."""
    if tensor.size(spec.split_dim) < num_chunks:
        # AssertionError, as PyTorch raises here (the target of a batch smaller than n_microbatches)
        raise AssertionError(
            f"Tensor size {tensor.size(spec.split_dim)} is smaller than num_chunks ({num_chunks}); "
            "use fewer microbatches or a larger batch"
        )
    chunks = torch.tensor_split(tensor, num_chunks, spec.split_dim)
    if tensor.requires_grad and tensor.is_leaf:
        for chunk in chunks:  # views of a leaf: keep their .grad so that backward can read it
            chunk.retain_grad()
    return chunks


def _split_dict(values: dict, specs: dict, num_chunks: int) -> list[dict]:
    """``values`` (a dict of arguments) as ``num_chunks`` dicts, or fewer when a tensor is too short."""
    if not values:
        return [{} for _ in range(num_chunks)]
    if set(values) != set(specs):
        raise ValueError(
            f"split_args_kwargs_into_chunks: the chunk spec names {sorted(map(str, specs))} but the arguments are "
            f"{sorted(map(str, values))}; give one spec per argument"
        )
    flat, tree = tree_flatten(values)
    flat_specs, _ = tree_flatten({key: specs[key] for key in values}, is_leaf=_is_replicate)
    if len(flat_specs) != len(flat):
        raise ValueError(
            f"split_args_kwargs_into_chunks: the chunk spec has {len(flat_specs)} leaves but the arguments have "
            f"{len(flat)}; the spec must mirror the arguments' structure"
        )
    sizes = [num_chunks]
    for value, spec in zip(flat, flat_specs):
        if _is_replicate(spec):
            continue
        if not isinstance(spec, TensorChunkSpec) or not isinstance(value, torch.Tensor):
            raise ValueError(f"Unsupported chunk spec: {spec} and value: {value} combination.")
        sizes.append(value.size(spec.split_dim))
    real_chunks = min(sizes)
    columns = [
        [value] * real_chunks if _is_replicate(spec) else _split_tensor(value, spec, real_chunks)
        for value, spec in zip(flat, flat_specs)
    ]
    return [tree_unflatten([column[i] for column in columns], tree) for i in range(real_chunks)]


def _default_spec(value: Any) -> Any:
    return TensorChunkSpec(DEFAULT_CHUNK_DIM) if isinstance(value, torch.Tensor) else _Replicate()


def split_args_kwargs_into_chunks(
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    chunks: int,
    args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
    kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
) -> tuple[list[tuple], list[dict]]:
    """Split ``args`` and ``kwargs`` into (at most) ``chunks`` microbatches: a list of args tuples and kwargs dicts."""
    kwargs = kwargs or {}
    if args_chunk_spec is None:
        args_chunk_spec = tree_map(_default_spec, tuple(args))
    if kwargs_chunk_spec is None:
        kwargs_chunk_spec = tree_map(_default_spec, kwargs)
    if len(args_chunk_spec) != len(args):
        raise ValueError(
            f"split_args_kwargs_into_chunks: args_chunk_spec has {len(args_chunk_spec)} entries for {len(args)} "
            "positional arguments; give one per argument"
        )
    arg_specs = dict(enumerate(args_chunk_spec))
    args_split = _split_dict(dict(enumerate(args)), arg_specs, chunks)
    kwargs_split = _split_dict(kwargs, dict(kwargs_chunk_spec), len(args_split))
    if len(kwargs_split) < len(args_split):  # a keyword tensor was shorter still: split both that finely
        args_split = _split_dict(dict(enumerate(args)), arg_specs, len(kwargs_split))
    return [tuple(chunk[i] for i in range(len(args))) for chunk in args_split], kwargs_split


def merge_chunks(chunks: list[Any], chunk_spec: Any) -> Any:
    """Merge the microbatch outputs ``chunks`` into one: concatenated along each spec's dim (default 0),
    folded by a reducer, or (any other spec) checked equal and taken once."""
    if chunk_spec is not None:
        flat_specs, tree = tree_flatten(chunk_spec)
    else:
        first, tree = tree_flatten(chunks[0])
        flat_specs = [TensorChunkSpec(DEFAULT_CHUNK_DIM)] * len(first)
    flat_chunks = []
    for chunk in chunks:
        flat, _ = tree_flatten(chunk)
        if len(flat) != len(flat_specs):
            raise ValueError(f"Chunk {chunk} did not match chunk spec {chunk_spec}")
        flat_chunks.append(flat)
    merged = []
    for i, spec in enumerate(flat_specs):
        column = [flat[i] for flat in flat_chunks]
        if isinstance(spec, TensorChunkSpec):
            merged.append(torch.cat(column, dim=spec.split_dim))
        elif isinstance(spec, _CustomReducer):
            value = spec.init_value
            for item in column:
                value = spec.reduce_fn(value, item)
            merged.append(value)
        else:
            for item in column[1:]:
                if not item == column[0]:
                    raise ValueError(f"merge_chunks: expected every chunk to hold {column[0]!r}, got {item!r}")
            merged.append(column[0])
    return tree_unflatten(merged, tree)
