"""Layer 0: stores (the side channel by which ranks find each other) and rendezvous."""

from .base import DEFAULT_STORE_TIMEOUT, Store
from .file_store import FileStore
from .hash_store import HashStore
from .prefix_store import PrefixStore
from .tcp_store import TCPStore

__all__ = ["Store", "HashStore", "FileStore", "TCPStore", "PrefixStore", "DEFAULT_STORE_TIMEOUT"]
