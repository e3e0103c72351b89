"""``torchdist.checkpoint``: PyTorch's distributed checkpoint (DCP) -- save and load sharded state in parallel.

Re-exports only. See docs/design/checkpoint.md for the file layout and the
plan/exchange steps; ``state_dict``, ``format_utils`` and ``staging`` are
submodules, as in PyTorch (which, like this package, imports ``staging`` here).
"""

from . import staging

from .api import CheckpointException
from .default_planner import DefaultLoadPlanner, DefaultSavePlanner
from .filesystem import FileSystemReader, FileSystemWriter
from .hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from .metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, TensorStorageMetadata
from .optimizer import load_sharded_optimizer_state_dict
from .planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from .state_dict_loader import load, load_state_dict
from .state_dict_saver import AsyncCheckpointerType, async_save, save, save_state_dict
from .stateful import Stateful
from .storage import StorageReader, StorageWriter

__all__ = [
    "save", "load", "async_save", "save_state_dict", "load_state_dict", "AsyncCheckpointerType",
    "CheckpointException", "Stateful",
    "FileSystemReader", "FileSystemWriter", "HuggingFaceStorageReader", "HuggingFaceStorageWriter", "StorageReader",
    "StorageWriter",
    "DefaultLoadPlanner", "DefaultSavePlanner", "LoadPlan", "LoadPlanner", "ReadItem", "SavePlan", "SavePlanner",
    "WriteItem",
    "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "TensorStorageMetadata",
    "load_sharded_optimizer_state_dict",
    "staging",
]
