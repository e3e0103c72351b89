"""Post-local SGD as a DDP communication hook: global gradient averaging, then local.

Lin, Stich, Patel and Jaggi, "Don't Use Large Mini-Batches, Use Local SGD"
(ICLR 2020): training starts as ordinary data-parallel SGD, which settles the
model, and switches to local SGD after ``start_localSGD_iter`` iterations::

    iteration < start_localSGD_iter:   all-reduce (average) each bucket over ``process_group``
    afterwards:                        average over ``subgroup`` (usually one node), or not at all
                                       when ``post_local_gradient_allreduce`` is False

Local SGD lets the replicas drift apart; a model averager
(:mod:`torchdist.algorithms.model_averaging.averagers`) run after each optimizer
step brings them back together every few steps. Its ``warmup_steps`` must equal
``start_localSGD_iter``.

``subgroup=None`` means the intra-node subgroups, made by ``new_subgroups()`` at the
first post-local iteration, as in PyTorch. PyTorch sizes them by the node's CUDA
devices and raises ValueError without CUDA; torchdist runs on CPU, so its
``new_subgroups()`` raises ValueError there too: pass a subgroup (for example
``new_subgroups(group_size=local_world_size)[0]``).
"""

import logging

import torch

from ..._c10d.groups import new_subgroups
from ..._ddp.bucket import GradBucket
from .default_hooks import _allreduce_fut

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

logger = logging.getLogger(__name__)


class PostLocalSGDState:
    """The groups and the iteration count of :func:`post_localSGD_hook`.

    Gradients are averaged over ``process_group`` (``None``: the default group) until
    iteration ``start_localSGD_iter``, over ``subgroup`` (``None``: the intra-node subgroup)
    afterwards, or kept local if ``post_local_gradient_allreduce`` is False. Either
    choice may converge faster; it is worth tuning.
    """

    __slots__ = ["process_group", "subgroup", "start_localSGD_iter", "post_local_gradient_allreduce", "iter"]

    def __init__(self, process_group, subgroup, start_localSGD_iter: int, post_local_gradient_allreduce: bool = True):
        logger.info("Local SGD will be started after %s iterations", start_localSGD_iter)
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count an iteration at its last bucket; log when local SGD starts."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            logger.info("Start to apply local SGD after %s iterations.", self.iter)


def post_localSGD_hook(state: PostLocalSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket globally before ``state.start_localSGD_iter``, within ``state.subgroup`` after.

    Run a model averager after each optimizer step, else the replicas never meet again::

        state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=10)
        ddp_model.register_comm_hook(state, post_localSGD_hook)
    """
    buffer = bucket.buffer()
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_fut(state.process_group, buffer)
    # The count stops here: nothing after the switch depends on it.
    if not state.post_local_gradient_allreduce:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    if state.subgroup is None:
        state.subgroup, _ = new_subgroups()
    return _allreduce_fut(state.subgroup, buffer)
