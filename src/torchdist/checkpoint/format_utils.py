"""Convert between a DCP checkpoint directory and a single ``torch.save`` file, in one process.

``dcp_to_torch_save`` allocates every saved tensor at its full shape from the
metadata, loads the checkpoint into them (re-assembling the chunks of sharded
tensors) and rebuilds the original nesting from the planner's key paths.
``torch_save_to_dcp`` is a one-process ``save`` of the loaded file.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ._traverse import set_element
from .default_planner import DefaultLoadPlanner
from .metadata import Metadata, TensorStorageMetadata
from .state_dict_loader import _load_state_dict
from .state_dict_saver import _save_state_dict
from .filesystem import FileSystemReader, FileSystemWriter

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]


class _EmptyStateDictLoadPlanner(DefaultLoadPlanner):
    """Loads everything the checkpoint holds, into full tensors it allocates from the metadata."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        if state_dict:
            raise ValueError("dcp_to_torch_save: the planner fills an empty state_dict; got one with keys "
                             f"{sorted(state_dict)[:5]}")
        paths = metadata.planner_data or {}
        for key, md in metadata.state_dict_metadata.items():
            # a placeholder for non-tensors, replaced by load_bytes; a full-size tensor for tensors
            value = (torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata)
                     else None)
            set_element(state_dict, paths.get(key, (key,)), value)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike, torch_save_path: str | os.PathLike) -> None:
    """Write the DCP checkpoint in ``dcp_checkpoint_dir`` as one ``torch.save`` file (nesting restored)."""
    state_dict: dict[str, Any] = {}
    _load_state_dict(state_dict, FileSystemReader(dcp_checkpoint_dir), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    torch.save(state_dict, torch_save_path)


def torch_save_to_dcp(torch_save_path: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike) -> None:
    """Write the ``torch.save`` file ``torch_save_path`` as a DCP checkpoint in ``dcp_checkpoint_dir``."""
    state_dict = torch.load(torch_save_path, weights_only=False)
    _save_state_dict(state_dict, FileSystemWriter(dcp_checkpoint_dir), no_dist=True)
