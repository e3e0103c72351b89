"""``torchdist.algorithms.model_averaging``: averaging parameters across ranks, for (post-)local SGD.

Re-exports only: ``averagers`` (``PeriodicModelAverager``), ``hierarchical_model_averager`` and
``utils``, PyTorch's modules of those names.
"""

from . import averagers, hierarchical_model_averager, utils

__all__ = ["averagers", "hierarchical_model_averager", "utils"]
