"""``torchdist.device_mesh``: PyTorch's ``torch.distributed.device_mesh`` (``DeviceMesh``, ``init_device_mesh``).

Three modules: ``_layout`` (which positions of the root mesh each dimension
walks), ``_setup`` (per-dimension backends and device selection, from the
arguments and the environment) and ``_mesh`` (the mesh, its process groups and
its views).
"""

from ._mesh import DeviceMesh, init_device_mesh

__all__ = ["init_device_mesh", "DeviceMesh"]
