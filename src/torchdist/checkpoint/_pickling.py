"""The ``.metadata`` file is a pickle that names PyTorch's classes, so either library reads the other's checkpoints.

Writing: a pickler that, for our metadata classes, writes the global name of
PyTorch's class of the same fields (``torch.distributed.checkpoint.metadata.
Metadata``, ...) without importing it. Reading: an unpickler whose
``find_class`` maps those names (and ours) to our classes, so a checkpoint
that ``torch.distributed.checkpoint`` wrote loads here without importing
torch.distributed, and torch loads ours with plain ``pickle.load``.
"""

from __future__ import annotations

import pickle
from typing import IO, Any

from . import metadata as _metadata

_TORCH_PACKAGE = "torch.distributed.checkpoint"

# our class -> (PyTorch's module, name); filled by register_torch_name
_TO_TORCH: dict[type, tuple[str, str]] = {}
# (module, name) as written in a pickle -> our class; both PyTorch's names and ours
_FROM_NAME: dict[tuple[str, str], type] = {}


def register_torch_name(cls: type, torch_module: str) -> None:
    """Pickle ``cls`` as ``torch.distributed.checkpoint.<torch_module>.<cls.__name__>``, and read either name."""
    module = f"{_TORCH_PACKAGE}.{torch_module}"
    _TO_TORCH[cls] = (module, cls.__name__)
    _FROM_NAME[(module, cls.__name__)] = cls
    _FROM_NAME[(cls.__module__, cls.__qualname__)] = cls


for _cls in (_metadata.ChunkStorageMetadata, _metadata.TensorProperties, _metadata._MEM_FORMAT_ENCODING,
             _metadata.TensorStorageMetadata, _metadata.BytesStorageMetadata, _metadata.StorageMeta,
             _metadata.Metadata, _metadata.MetadataIndex):
    register_torch_name(_cls, "metadata")


class _TorchNamingPickler(pickle._Pickler):
    """The pure-Python pickler, whose ``save_global`` can write a name without importing its module."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and obj in _TO_TORCH and self.proto >= 4:
            module, qualname = _TO_TORCH[obj]
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


class _MappingUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _FROM_NAME:
            return _FROM_NAME[(module, name)]
        if module == "torch.distributed" or module.startswith("torch.distributed."):
            raise pickle.UnpicklingError(
                f"checkpoint metadata: the file refers to {module}.{name}, which torchdist.checkpoint does not "
                "know; it was written by a PyTorch feature that torchdist does not support (e.g. a custom planner "
                "or storage); load it with torch.distributed.checkpoint")
        return super().find_class(module, name)


def dump_metadata(metadata: _metadata.Metadata, stream: IO[bytes]) -> None:
    _TorchNamingPickler(stream, protocol=4).dump(metadata)


def load_metadata(stream: IO[bytes]) -> _metadata.Metadata:
    return _MappingUnpickler(stream).load()
