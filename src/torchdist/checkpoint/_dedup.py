"""Replicated items are written once: the coordinator keeps each (key, offsets) in one rank's plan.

Among the ranks that hold an item, it goes to the one with the fewest bytes
assigned so far (ties to the lowest rank), so that replicated state is spread
over the ranks' files instead of all landing on rank 0; or, with
``save_to_lowest_rank``, always to the lowest rank. PyTorch does the same.
"""

from __future__ import annotations

import dataclasses

from .metadata import MetadataIndex
from .planner import SavePlan, WriteItem


def dedup_save_plans(all_plans: list[SavePlan], save_to_lowest_rank: bool = False) -> list[SavePlan]:
    """Copies of ``all_plans`` in which each item index appears in exactly one plan."""
    holders: dict[MetadataIndex, list[int]] = {}
    first_item: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            first_item.setdefault(item.index, item)
    assigned_bytes = [0] * len(all_plans)
    owner: dict[MetadataIndex, int] = {}
    for index, ranks in holders.items():
        chosen = ranks[0] if save_to_lowest_rank else min(ranks, key=lambda r: (assigned_bytes[r], r))
        owner[index] = chosen
        assigned_bytes[chosen] += first_item[index].tensor_storage_size() or 1
    return [dataclasses.replace(plan, items=[item for item in plan.items if owner[item.index] == rank])
            for rank, plan in enumerate(all_plans)]
