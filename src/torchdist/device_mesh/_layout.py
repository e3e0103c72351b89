"""Mesh layouts: which positions of the root mesh's rank list each mesh dimension walks.

Vocabulary, fixed here once. The *rank map* is the root mesh's global ranks as a
flat, row-major list. A *mode* is a pair (size, stride): ``size`` steps of
``stride`` positions in the rank map. An *axis* (one mesh dimension) is a tuple of
modes, outermost first; a flattened dimension has several. A *layout* is one axis
per mesh dimension. This is the CuTe notation that PyTorch's DeviceMesh adopted
(``torch.distributed._mesh_layout``): slicing keeps some axes, ``_flatten``
concatenates them, ``_unflatten`` splits one (``MeshLayout.unflatten``), and all
these views share the root's rank map.

Example, a 2x2 mesh ``[[0, 1], [2, 3]]``: the layout is ``((2:2), (2:1))``. Its
"dp" dimension, the axis ``(2:2)``, visits positions {0, 2} from offset 0 and
{1, 3} from offset 1: those are the "dp" process groups. The offsets are the
*complement* of the axis, the positions no other group has covered yet.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

__all__ = ["Mode", "MeshLayout", "coalesce"]

Mode = tuple[int, int]  # (size, stride)


def coalesce(modes: tuple[Mode, ...] | list[Mode]) -> tuple[Mode, ...]:
    """Drop size-1 modes and merge neighbours that walk contiguously: (2:2)(2:1) is (4:1)."""
    out: list[Mode] = []
    for size, stride in modes:
        if size == 1:
            continue
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return tuple(out)


def _offsets_from_zero(modes: tuple[Mode, ...]) -> list[int]:
    """The positions ``modes`` visits from position 0, in row-major order of its coordinates."""
    return [sum(c * stride for c, (_, stride) in zip(coord, modes))
            for coord in itertools.product(*(range(size) for size, _ in modes))]


def _walk(axis: tuple[Mode, ...], size: int, stride: int) -> tuple[Mode, ...]:
    """The positions of ``axis`` at its indices ``0, stride, ..., (size - 1) * stride``, as modes.

    An axis's index counts through its modes row-major, the innermost fastest, so the
    walk first skips ``stride`` indices through the innermost modes, then takes
    ``size`` steps outwards; each mode it crosses must divide evenly (CuTe's
    composition condition), as it does when an unflattened size divides its axis.
    """
    taken: list[Mode] = []
    for mode_size, mode_stride in reversed(axis):
        if size == 1:
            break
        if stride >= mode_size:  # skipped whole: the walk steps over this mode
            if stride % mode_size:
                raise ValueError(f"cannot walk {size} steps of {stride} through the axis {axis}")
            stride //= mode_size
            continue
        if mode_size % stride:
            raise ValueError(f"cannot walk {size} steps of {stride} through the axis {axis}")
        room = mode_size // stride
        steps = min(room, size)
        if room % steps or size % steps:
            raise ValueError(f"cannot walk {size} steps of {stride} through the axis {axis}")
        taken.append((steps, mode_stride * stride))
        size //= steps
        stride = 1
    if size != 1:
        raise ValueError(f"{size} more steps of {stride} run past the end of the axis {axis}")
    return coalesce(list(reversed(taken)))


@dataclass(frozen=True)
class MeshLayout:
    """One axis (a tuple of coalesced modes) per mesh dimension."""

    axes: tuple[tuple[Mode, ...], ...]

    @classmethod
    def from_sizes_strides(cls, sizes: tuple[int, ...], strides: tuple[int, ...] | None = None) -> MeshLayout:
        if strides is None:
            strides = tuple(math.prod(sizes[i + 1:]) for i in range(len(sizes)))
        return cls(tuple(coalesce([(size, stride)]) for size, stride in zip(sizes, strides)))

    def __len__(self) -> int:
        return len(self.axes)

    def __getitem__(self, dim: int) -> tuple[Mode, ...]:
        return self.axes[dim]

    @property
    def sizes(self) -> tuple[int, ...]:
        """The mesh's shape: the number of positions along each dimension."""
        return tuple(math.prod(size for size, _ in axis) for axis in self.axes)

    def numel(self) -> int:
        return math.prod(self.sizes)

    def collapse(self) -> tuple[Mode, ...]:
        """All axes as one axis: the positions of the whole mesh, in its row-major order."""
        return coalesce([mode for axis in self.axes for mode in axis])

    def cosize(self) -> int:
        """One past the largest position the layout reaches."""
        return 1 + sum((size - 1) * stride for size, stride in self.collapse())

    def is_orthogonal(self) -> bool:
        """No position is reached twice: sorted by stride, each mode fits inside the next one's step."""
        modes = sorted(((stride, size) for size, stride in self.collapse()), reverse=True)
        return all(modes[i][0] % (modes[i + 1][0] * modes[i + 1][1]) == 0 for i in range(len(modes) - 1))

    def is_sorted(self) -> bool:
        """Strides descend: the dimensions keep the order they have in the root mesh."""
        strides = [stride for _, stride in self.collapse()]
        return strides == sorted(strides, reverse=True)

    def remap_to_tensor(self, rank_map: torch.Tensor) -> torch.Tensor:
        """Every copy of this layout in the rank map, as a tensor of shape (copies, *sizes).

        Copy i starts at the i-th smallest position that no earlier copy reached, so
        for a single axis the rows are that dimension's process groups, in the order
        PyTorch creates them.
        """
        from_zero = _offsets_from_zero(self.collapse())
        covered: set[int] = set()
        starts = []
        for start in range(rank_map.numel()):
            if start not in covered and start + from_zero[-1] < rank_map.numel():
                starts.append(start)
                covered.update(start + p for p in from_zero)
        index = torch.tensor([[start + p for p in from_zero] for start in starts], dtype=torch.long)
        return rank_map[index].reshape(-1, *self.sizes)

    def unflatten(self, dim: int, sizes: tuple[int, ...]) -> MeshLayout:
        """This layout with dimension ``dim`` split into dimensions of ``sizes`` (row-major,
        their product its size): dimension ``dim`` composed with the layout of ``sizes``."""
        inner_strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
        split = tuple(_walk(self.axes[dim], size, stride) for size, stride in zip(sizes, inner_strides))
        return MeshLayout(self.axes[:dim] + split + self.axes[dim + 1:])

    def repr_strides(self) -> tuple[int | tuple[int, ...], ...]:
        """Per dimension, its stride, or a tuple of strides if it has other than one mode (as PyTorch prints)."""
        return tuple(axis[0][1] if len(axis) == 1 else tuple(stride for _, stride in axis) for axis in self.axes)
