"""torch's ``rendezvous.registry`` module path: :func:`get_rendezvous_handler` (the backends register in
``rendezvous/__init__.py``)."""

from __future__ import annotations

from . import get_rendezvous_handler

__all__ = ["get_rendezvous_handler"]
