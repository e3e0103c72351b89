"""Shared-memory segments, their lifetime, and the OS primitives the shm transport needs.

Everything that touches the operating system for the shared-memory transport is
here, so OS errors become :class:`~torchdist.errors.DistNetworkError` in one place:

- *segments*: one file per rank under ``/dev/shm`` (``TORCHDIST_SHM_DIR``), named
  ``torchdist-shm-<token>-<rank>``, mapped ``MAP_SHARED | MAP_POPULATE`` (so the
  first op does not pay for page faults: measured, an untouched 64 MiB region made
  the first op 80 ms instead of 14 ms);
- *lifetime* (no leaked files, whatever happens): the owner holds an exclusive
  ``flock`` on its file from creation on. Once every rank of the group has mapped
  every segment, each owner unlinks its file: from then on the memory lives only
  as long as some process maps it, and the kernel frees it when the last one
  exits, SIGKILL included. A job killed *during* setup leaves files behind; the
  next job's setup removes every ``torchdist-shm-*`` file whose lock nobody holds
  (the kernel drops a dead process's locks) and which is older than a few seconds;
- *liveness*: the same lock tells whether a peer's process is alive: a peer can
  take ``LOCK_SH`` on a segment only once its owner is gone. Unlike a pid check
  this sees a killed rank at once even while it is an unreaped zombie, and pid
  reuse cannot fool it. The lock is held through a file description of its own
  (``mmap`` dups the mapping fd, and a child forked by the rank closes its copy of
  the lock fd), so only the rank itself keeps it;
- *doorbells*: a process-shared POSIX semaphore in each segment (``sem_init``
  with ``pshared=1``), which peers post to wake a rank that sleeps in
  ``sem_timedwait`` (a futex underneath);
- :func:`fence`: a full memory barrier (see its docstring);
- :func:`host_identity`: which ranks may share memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import platform
import secrets
import socket
import threading
import time
import weakref
from datetime import timedelta

from ..errors import DistNetworkError, DistStoreError

__all__ = ["Segment", "Doorbell", "fence", "host_identity", "shm_dir", "clean_stale_segments",
           "wait_until_all_mapped", "supported", "PREFIX"]

logger = logging.getLogger(__name__)

PREFIX = "torchdist-shm-"
#: A setup file whose lock nobody holds is only removed once it is this old (s), so a
#: job that has created its file but not yet locked it (microseconds) is never hit.
_STALE_AGE_S = 5.0

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_libc.sem_post.argtypes = [ctypes.c_void_p]
_libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
# sem_clockwait (glibc >= 2.30) takes a monotonic deadline, immune to wall-clock jumps.
_sem_clockwait = getattr(_libc, "sem_clockwait", None)
if _sem_clockwait is not None:
    _sem_clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_FENCE_LOCK = threading.Lock()


def fence() -> None:
    """A full memory barrier (StoreLoad included) between this thread's accesses.

    Acquiring and releasing a lock is an atomic read-modify-write (``lock cmpxchg``
    in glibc's semaphores and in CPython's own mutexes), and on x86 every locked
    instruction is a full fence. The shm transport needs one in exactly one place:
    the sleep/wake handshake, where "store my flag, then load the peer's counter"
    must not be reordered (x86 may reorder a store with a later load).
    """
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def supported() -> str | None:
    """None if shared-memory collectives can run here, else why not.

    The transport publishes progress with plain aligned 8-byte stores and polls
    them with plain loads. That is correct on x86-64 only: its stores are seen in
    program order (TSO) and aligned 8-byte accesses are atomic. Other CPUs need
    real acquire/release barriers, which Python cannot issue, so there "auto"
    uses TCP and "shm" refuses, saying why.
    """
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"the shared-memory transport needs an x86-64 CPU (this one is {machine})"
    if not os.path.isdir(shm_dir()):
        return f"the shared-memory directory {shm_dir()} does not exist (set TORCHDIST_SHM_DIR)"
    return None


def shm_dir() -> str:
    return os.environ.get("TORCHDIST_SHM_DIR", "/dev/shm")


def host_identity() -> str:
    """What ranks must share to share memory: host, boot, mount namespace, shm file system.

    ``TORCHDIST_HOST_ID`` overrides it (tests use it to simulate several hosts)."""
    explicit = os.environ.get("TORCHDIST_HOST_ID")
    if explicit:
        return explicit
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("?")
    try:
        parts.append(os.readlink("/proc/self/ns/mnt"))
    except OSError:
        parts.append("?")
    try:
        parts.append(str(os.stat(shm_dir()).st_dev))
    except OSError:
        parts.append("?")
    return "/".join(parts)


def clean_stale_segments() -> int:
    """Remove segments left by dead jobs (killed during setup); returns how many."""
    directory, removed = shm_dir(), 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX)]
    except OSError:
        return 0
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < _STALE_AGE_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner is alive
            os.unlink(path)
            removed += 1
            logger.info("removed %s, left behind by a job that died during setup", path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


# Lock fds of the live segments, closed in children forked by a rank (see the docstring).
_LOCK_FDS: "weakref.WeakSet[Segment]" = weakref.WeakSet()


def _close_lock_fds_in_child() -> None:
    for segment in list(_LOCK_FDS):
        segment.drop_lock()


os.register_at_fork(after_in_child=_close_lock_fds_in_child)


class Segment:
    """One rank's mapped segment: ``buf`` (an ``mmap``) and ``address`` (its base)."""

    def __init__(self, path: str, size: int, owner: bool, lock_fd: int, buf: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        self._lock_fd = lock_fd
        self.buf = buf
        anchor = ctypes.c_char.from_buffer(buf)
        self.address = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping exists
        self.unlinked = False
        _LOCK_FDS.add(self)

    @classmethod
    def create(cls, size: int, rank: int, label: str) -> "Segment":
        """Create, lock and map a fresh zero-filled segment for this rank."""
        path = os.path.join(shm_dir(), f"{PREFIX}{secrets.token_hex(8)}-{rank}")
        try:
            lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise DistNetworkError(f"{label}: rank {rank} cannot create the shared-memory segment "
                                   f"{path}: {exc}") from exc
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            os.ftruncate(lock_fd, size)
            try:
                os.posix_fallocate(lock_fd, 0, size)  # fail now, not with SIGBUS later
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            buf = _map(path, size)
        except OSError as exc:
            os.close(lock_fd)
            _unlink_quietly(path)
            advice = ("raise the limit on open files (ulimit -n)" if exc.errno in (errno.EMFILE, errno.ENFILE) else
                      "free space there or use backend='tcp'")
            raise DistNetworkError(f"{label}: rank {rank} cannot allocate {size} bytes of shared memory in "
                                   f"{shm_dir()}: {exc}; {advice}.") from exc
        return cls(path, size, True, lock_fd, buf)

    @classmethod
    def attach(cls, path: str, size: int, label: str, peer: int) -> "Segment":
        """Map a peer's segment; keep a file description to test its owner's liveness."""
        try:
            lock_fd = os.open(path, os.O_RDONLY)
            try:
                actual = os.fstat(lock_fd).st_size
                if actual != size:
                    raise OSError(errno.EINVAL, f"size {actual}, expected {size}")
                buf = _map(path, size)
            except OSError:
                os.close(lock_fd)
                raise
        except OSError as exc:
            raise DistNetworkError(f"{label}: cannot map rank {peer}'s shared-memory segment {path}: {exc}. "
                                   "Are all ranks on one host, sharing its /dev/shm?") from exc
        return cls(path, size, False, lock_fd, buf)

    def unlink(self) -> None:
        """Remove the file name; the memory lives on while mapped (owner only)."""
        if self.owner and not self.unlinked:
            _unlink_quietly(self.path)
            self.unlinked = True

    def remove_name(self) -> None:
        """A peer's segment whose owner exited before unlinking it: remove the name, so
        that the memory goes when the last mapping does instead of outliving the job."""
        _unlink_quietly(self.path)

    def owner_alive(self) -> bool:
        """Whether the process that created this segment still holds it: it has neither
        closed it (left the group) nor died. Peers only."""
        if self._lock_fd < 0:
            return False
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # the owner's exclusive lock is still held
        except OSError:
            return False
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        """Unlink (owner), drop the lock and the mapping. Views into ``buf`` that are
        still alive keep the mapping until they are garbage collected."""
        self.unlink()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        try:
            self.buf.close()
        except BufferError:
            logger.debug("%s: views still exported; the mapping goes with them", self.path)

    def drop_lock(self) -> None:
        """Close the lock's descriptor (a forked child's copy, or one nobody will test)."""
        if self._lock_fd >= 0:
            try:
                os.close(self._lock_fd)
            except OSError:
                pass
            self._lock_fd = -1


#: While ranks wait for each other to map their segments, how often they check that
#: the ranks they wait for still live (s).
SETUP_CHECK_S = 0.5


def wait_until_all_mapped(store, key: str, rank: int, segments: list[Segment], timeout: float, names: list[int],
                          label: str) -> None:
    """The barrier after every rank mapped everyone's ``segments`` (``segments[rank]`` is
    this rank's own), in slices of :data:`SETUP_CHECK_S`. Between slices, a peer whose
    segment lock is free died (or gave up) before arriving: its segment's name, which it
    can no longer unlink, is removed, and the error names it at once instead of at the
    timeout."""
    deadline = time.monotonic() + timeout
    while True:
        wait = min(SETUP_CHECK_S, max(deadline - time.monotonic(), 0.001))
        try:
            store.arrive_and_wait(key, rank, len(segments), timedelta(seconds=wait))
            return
        except DistStoreError:
            gone = [p for p, segment in enumerate(segments) if p != rank and not segment.owner_alive()]
            if gone:
                for p in gone:
                    segments[p].remove_name()
                raise DistNetworkError(
                    f"{label}: ranks {[names[p] for p in gone]} exited while shared memory was being set up "
                    f"(rank {names[rank]} waited for them to map it); see their logs for why.") from None
            if time.monotonic() >= deadline:
                missing = [names[p] for p in range(len(segments)) if not store.check([f"{key}/{p}"])]
                raise DistStoreError(
                    f"{label}: rank {names[rank]} timed out after {timeout:.1f}s waiting for ranks {missing} "
                    "to map the group's shared memory; they are alive but did not get there (stalled, or "
                    "not creating this group): check that every rank creates the same groups in the same "
                    "order, or raise the timeout.") from None


def _map(path: str, size: int) -> mmap.mmap:
    # A description of its own for the mapping: mmap keeps a dup of it, which must
    # not share the description that holds the owner's lock.
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)


class Doorbell:
    """A process-shared semaphore at ``address`` (inside a segment): ``ring()`` wakes
    the one rank that ``sleep()`` s on it. Posts may accumulate; the sleeper treats
    every wake-up as "go and look", never as a count."""

    __slots__ = ("address",)

    def __init__(self, address: int) -> None:
        self.address = address

    def init(self) -> None:
        if _libc.sem_init(self.address, 1, 0) != 0:
            code = ctypes.get_errno()
            raise DistNetworkError(f"sem_init failed: {os.strerror(code)}")

    def ring(self) -> None:
        _libc.sem_post(self.address)

    def sleep(self, seconds: float) -> None:
        """Block until rung or ``seconds`` pass (the GIL is released meanwhile)."""
        # EINTR and ETIMEDOUT need no handling: the caller looks again either way.
        if _sem_clockwait is not None:
            when = time.clock_gettime(time.CLOCK_MONOTONIC) + max(seconds, 0.0)
            spec = _Timespec(int(when), int((when % 1.0) * 1e9))
            _sem_clockwait(self.address, time.CLOCK_MONOTONIC, ctypes.byref(spec))
        else:
            when = time.time() + max(seconds, 0.0)
            spec = _Timespec(int(when), int((when % 1.0) * 1e9))
            _libc.sem_timedwait(self.address, ctypes.byref(spec))
