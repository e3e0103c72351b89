"""8-bit gradient quantization as DDP communication hooks (PyTorch's ``quantization_hooks``).

Each rank quantizes its bucket to uint8 with its own affine parameters, all-gathers the
parameters and the quantized buckets, then dequantizes every rank's bucket and averages them
locally::

    scale = max((max(x, 0) - min(x, 0)) / 255, eps)    zero_point = clamp(-round(min(x, 0) / scale), 0, 255)
    q = clamp(round(x / scale) + zero_point, 0, 255)    x ~ scale * (q - zero_point)

The parameters are those of ``torch.ao.quantization``'s ``MinMaxObserver`` (quint8, affine),
computed in float32 as the observer does. :func:`quantization_perchannel_hook` gives each run
of ``bucket_size`` elements (a "channel") its own scale and zero point: a finer resolution for
large buckets. An all-gather moves ``world_size`` times the bytes of an all-reduce, so these
hooks, experimental in PyTorch too, send a quarter of fp32's bytes but gather them from every
rank. As everywhere in this package, ``process_group`` is the group to use (``None``: the
default group).

Where these differ from PyTorch's hooks (the numbers are the same):

- PyTorch's hooks read an all-gather future's value as ``[ranks' tensors stacked]`` (the
  per-channel hook indexes it ``[rank, 0, :]``); PyTorch 2.13's gloo gives ``[tensor of each
  rank]``, and both hooks raise IndexError there (measured). These read the output lists
  they passed in.
- Both all-gathers are issued in the hook, without waiting: a rank quantizes with its own
  parameters, so it needs nobody's before sending. PyTorch issues the second from the first's
  future callback, which races the next bucket's hook (see :mod:`.powerSGD_hook`).
- A bucket is padded with zeros to the next multiple of ``bucket_size``; PyTorch pads a whole
  channel more when it is one already. Zeros never change a channel's parameters (its range
  always includes 0), so only the bytes differ.
- ``bucket_size`` below 1 is a ValueError (PyTorch: ZeroDivisionError or a view error).
"""

import torch

from ..._c10d.collectives import all_gather
from ..._ddp.bucket import GradBucket
from .default_hooks import _group

__all__ = ["quantization_pertensor_hook", "quantization_perchannel_hook"]

_QUANT_MIN, _QUANT_MAX = 0, 255  # quint8
_EPS = torch.tensor(torch.finfo(torch.float32).eps)


def _qparams(min_val: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """Scales and zero points (float32, stacked: shape ``(2, *min_val.shape)``) for the ranges given."""
    min_neg = torch.min(min_val, torch.zeros_like(min_val))
    max_pos = torch.max(max_val, torch.zeros_like(max_val))
    scale = torch.max((max_pos - min_neg) / float(_QUANT_MAX - _QUANT_MIN), _EPS)
    zero_point = torch.clamp(_QUANT_MIN - torch.round(min_neg / scale).to(torch.int), _QUANT_MIN, _QUANT_MAX)
    return torch.stack((scale, zero_point.to(torch.float32)))


def _quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    # PyTorch divides row by row by a 0-d scale, which leaves a float16 or bfloat16 ``x`` in
    # its dtype; a column of scales would promote it to float32 and round differently.
    return torch.clamp(torch.round((x / scale).to(x.dtype)) + zero_point, _QUANT_MIN, _QUANT_MAX).to(torch.uint8)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return scale * (q.to(torch.float32) - zero_point)


def _gather_and_average(process_group, params: torch.Tensor, x: torch.Tensor,
                        per_channel: bool) -> torch.futures.Future[torch.Tensor]:
    """Quantize ``x`` with ``params`` (this rank's), all-gather both, and average the ranks' dequantized ``x``.

    Per channel, ``x`` is ``(channels, bucket_size)`` and ``params`` ``(2, channels)``; the
    scale and zero point then apply row by row.
    """
    group = _group(process_group)
    world_size = group.size()
    scale, zero_point = (params[0, :, None], params[1, :, None]) if per_channel else (params[0], params[1])
    quantized = _quantize(x, scale, zero_point)
    all_params = [torch.empty_like(params) for _ in range(world_size)]
    all_quantized = [torch.empty_like(quantized) for _ in range(world_size)]
    futures = [all_gather(all_params, params, group=group, async_op=True).get_future(),
               all_gather(all_quantized, quantized, group=group, async_op=True).get_future()]

    def dequantize_and_average(fut: torch.futures.Future) -> torch.Tensor:
        for done in fut.wait():
            done.wait()  # raises the all-gather's error, if any
        total = torch.zeros_like(quantized, dtype=torch.float32)
        for rank_params, rank_quantized in zip(all_params, all_quantized):  # in rank order, as PyTorch sums
            if per_channel:
                total += _dequantize(rank_quantized, rank_params[0, :, None], rank_params[1, :, None])
            else:
                total += _dequantize(rank_quantized, rank_params[0], rank_params[1])
        return total / world_size

    return torch.futures.collect_all(futures).then(dequantize_and_average)


def quantization_pertensor_hook(process_group, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks, each rank's quantized to uint8 with one scale and zero point.

    The future's value is a new float32 tensor (the bucket itself is left as it is).
    Example: ``ddp_model.register_comm_hook(process_group, quantization_pertensor_hook)``.
    """
    tensor = bucket.buffer()
    min_val, max_val = torch.aminmax(tensor.detach().to(torch.float32))
    return _gather_and_average(process_group, _qparams(min_val, max_val), tensor, per_channel=False)


def quantization_perchannel_hook(process_group, bucket: GradBucket,
                                 bucket_size: int = 512) -> torch.futures.Future[torch.Tensor]:
    """As :func:`quantization_pertensor_hook`, with a scale and zero point per ``bucket_size`` elements.

    Example: ``ddp_model.register_comm_hook(process_group, quantization_perchannel_hook)``;
    ``functools.partial(quantization_perchannel_hook, bucket_size=128)`` for finer channels.
    """
    if bucket_size < 1:
        raise ValueError(f"quantization_perchannel_hook: bucket_size must be at least 1, got {bucket_size}")
    tensor = bucket.buffer()
    numel = tensor.numel()
    channels = torch.nn.functional.pad(tensor, (0, -numel % bucket_size)).view(-1, bucket_size)
    min_val, max_val = torch.aminmax(channels.detach().to(torch.float32), dim=1)
    fut = _gather_and_average(process_group, _qparams(min_val, max_val), channels, per_channel=True)
    return fut.then(lambda done: done.value().flatten()[:numel])
