"""``visualize_sharding``: print which rank holds which block of a 1-D or 2-D DTensor.

The table is the one PyTorch prints with ``tabulate`` (its "simple" format, ``showindex`` for the row ranges),
drawn here without the dependency::

             Col 0-2    Col 3-5
    -------  ---------  ---------
    Row 0-3  cpu:0      cpu:1
    Row 4-7  cpu:2      cpu:3

A cell lists every rank holding that block (``cpu:0,1`` when replicated); ranges are inclusive, a 1-D tensor is
one column ``Col 0-0``. Only the rank at coordinate 0 of every mesh dimension prints. PyTorch's coloured
``use_rich=True`` table needs ``rich`` and ``matplotlib``; torchdist prints the plain table for it.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from .._spec import compute_local_shape_and_global_offset

__all__ = ["visualize_sharding"]

Block = tuple[tuple[int, int], tuple[int, int], int]  # (first row, last row), (first col, last col), rank


def _simple_table(rows: Sequence[Sequence[str]], headers: Sequence[str], index: Sequence[str]) -> str:
    """tabulate's "simple" format for string cells, headers and an index column: left-aligned, two spaces
    between columns, a header column at least two wider than its name, no trailing blanks."""
    columns = [[""] + list(index)] + [[header] + [row[c] for row in rows] for c, header in enumerate(headers)]
    widths = [max(max(len(cell) for cell in column[1:]), len(column[0]) + 2) for column in columns]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    out = [line([column[0] for column in columns]), line(["-" * width for width in widths])]
    out.extend(line([column[r] for column in columns]) for r in range(1, len(index) + 1))
    return "\n".join(out)


def _create_table(blocks: list[Block], device_kind: str = "") -> str:
    row_ranges = sorted({block[0] for block in blocks})
    col_ranges = sorted({block[1] for block in blocks})
    cells: dict[tuple[int, int], list[str]] = {}
    for rows, cols, rank in blocks:
        cells.setdefault((row_ranges.index(rows), col_ranges.index(cols)), []).append(str(rank))
    matrix = [[f"{device_kind}:" + ",".join(cells.get((r, c), [])) if (r, c) in cells else ""
               for c in range(len(col_ranges))] for r in range(len(row_ranges))]
    return _simple_table(matrix, [f"Col {c[0]}-{c[1]}" for c in col_ranges],
                         [f"Row {r[0]}-{r[1]}" for r in row_ranges])


def visualize_sharding(dtensor, header: str = "", use_rich: bool = False) -> None:
    """Print the sharding table of a 1-D or 2-D ``dtensor`` (PyTorch's signature; ``header`` is unused there
    too). Every rank of the mesh must call it; one prints. Empty tensors print nothing."""
    if dtensor.numel() == 0:
        return
    if len(dtensor.shape) >= 3:
        raise RuntimeError("visualize sharding supports only 1D or 2D DTensor")
    mesh = dtensor.device_mesh
    if mesh.get_coordinate() is None:
        return
    if any(mesh.get_local_rank(mesh_dim=dim) != 0 for dim in range(mesh.ndim)):
        return
    ranks = mesh.mesh.tolist()
    blocks: list[Block] = []
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        rank = ranks
        for i in coordinate:
            rank = rank[i]
        shape, offset = compute_local_shape_and_global_offset(dtensor.shape, mesh, dtensor.placements, coordinate)
        if len(shape) == 1:
            shape, offset = (shape[0], 1), (offset[0], 0)
        blocks.append(((offset[0], offset[0] + shape[0] - 1), (offset[1], offset[1] + shape[1] - 1), int(rank)))
    print(_create_table(blocks, device_kind=mesh.device_type))
