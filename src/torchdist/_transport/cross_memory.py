"""Reading a peer process's memory directly: Linux cross-memory attach (CMA).

``process_vm_readv(pid, local, remote)`` copies bytes out of another process's
address space in one pass, inside the kernel. For collectives on one host this
means a rank can read a peer's *ordinary* tensor where it lies, without the
peer first copying it into shared memory: an all-reduce at world 4 moves 2.75
bytes per rank and byte instead of the shared-memory pipeline's 4.75
(``_algorithms/shm_direct``). MPI implementations use the same call for large
messages on one host.

The kernel allows it only where ``ptrace`` would be allowed (same user; Yama's
``ptrace_scope`` or a seccomp profile may forbid it), so a group *probes* it
while it sets up (``probe``) and uses it only if every rank could read every
peer. ``TORCHDIST_SHM_CMA=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

__all__ = ["enabled", "probe", "read"]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.c_ulong]


def enabled() -> bool:
    """Whether this process may try CMA at all (the C library has it, and it is not switched off)."""
    return _readv is not None and os.environ.get("TORCHDIST_SHM_CMA", "1") != "0"


def read(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote`` in process ``pid`` to ``local`` in ours.

    Raises ``OSError`` (``ESRCH``: the process is gone; ``EFAULT``: the range is not
    mapped there; ``EPERM``: not allowed). Like every ctypes call, releases the GIL.
    """
    while nbytes > 0:
        mine, theirs = _IoVec(local, nbytes), _IoVec(remote, nbytes)
        got = _readv(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        if got == 0:  # a partial read stops at an unmapped page; zero means the first one is
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid}: address {remote:#x} is not mapped")
        remote, local, nbytes = remote + got, local + got, nbytes - got


def probe(pid: int, remote: int, expected: bytes) -> bool:
    """Whether reading ``len(expected)`` bytes at ``remote`` in ``pid`` works and gives ``expected``."""
    if not enabled():
        return False
    buf = ctypes.create_string_buffer(len(expected))
    try:
        read(pid, remote, ctypes.addressof(buf), len(expected))
    except OSError:
        return False
    return buf.raw == expected
