"""DDP's settings, parsed and checked once, as a frozen dataclass.

Vocabulary used across ``torchdist._ddp``:

- *parameter index*: a parameter's position in the list DDP reduces (the
  module's parameters that require grad, shared ones once, ignored ones left out);
- *bucket*: a group of parameters whose gradients are all-reduced by one
  collective over one flat tensor;
- *coalesced bucket*: a bucket that owns its flat tensor; each gradient is copied
  into its slot;
- *solo bucket*: one large parameter whose flat tensor is its own ``.grad``
  (flattened), all-reduced in place: nothing is copied;
- *ready*: a parameter is ready once its gradient for this iteration has been
  accumulated (its autograd hook fired) and placed in its bucket; a bucket is
  ready when all its parameters are.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DDPConfig", "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_BYTES", "DEFAULT_SOLO_PARAM_BYTES", "MiB"]

MiB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0
#: PyTorch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: the first bucket (the last layers'
#: gradients, which arrive first) is kept small so that communication starts early.
#: As in PyTorch, only with the default ``bucket_cap_mb``: a cap the user chose applies
#: to the first bucket too.
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB
#: A parameter of at least this many bytes (or of at least its bucket's limit) gets a
#: solo bucket: its gradient is all-reduced in place instead of being copied into a
#: flat tensor and back. Below it, coalescing wins: on the 2-core VM one more
#: collective costs 0.1-0.3 ms (issue, worker wake-up), copying 1 MiB in and out
#: about as much (docs/benchmarks.md, "DDP").
DEFAULT_SOLO_PARAM_BYTES = 1 * MiB


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """How the Reducer buckets and reduces gradients (validated in ``__post_init__``)."""

    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    first_bucket_bytes: int | None = DEFAULT_FIRST_BUCKET_BYTES  # None: as large as the others
    bucket_cap_mb_list: tuple[float, ...] | None = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    solo_param_bytes: int = DEFAULT_SOLO_PARAM_BYTES

    def __post_init__(self) -> None:
        if self.solo_param_bytes <= 0:
            raise ValueError(f"solo_param_bytes must be positive, got {self.solo_param_bytes!r}")
        if self.first_bucket_bytes is not None and self.first_bucket_bytes <= 0:
            raise ValueError(f"first_bucket_bytes must be positive, got {self.first_bucket_bytes!r}")
        if self.bucket_cap_mb_list is not None:
            if not self.bucket_cap_mb_list or any(not mb > 0 for mb in self.bucket_cap_mb_list):
                raise ValueError(
                    f"bucket_cap_mb_list must be a non-empty list of positive sizes in MiB, "
                    f"got {list(self.bucket_cap_mb_list)!r}")

    @property
    def bucket_bytes_cap(self) -> int:
        return int(self.bucket_cap_mb * MiB)

    def size_limits(self) -> list[int]:
        """Byte limits of the buckets in order; the last one repeats for all later buckets."""
        if self.bucket_cap_mb_list is not None:
            return [int(mb * MiB) for mb in self.bucket_cap_mb_list]
        if self.first_bucket_bytes is None:
            return [self.bucket_bytes_cap]
        return [min(self.first_bucket_bytes, self.bucket_bytes_cap), self.bucket_bytes_cap]
