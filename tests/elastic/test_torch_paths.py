"""Every public name of torch.distributed.elastic's modules imports from the same path under torchdist.elastic."""

from __future__ import annotations

import importlib
import types

import pytest

MODULES = [
    "agent.server",
    "agent.server.api",
    "agent.server.local_elastic_agent",
    "events",
    "events.api",
    "metrics",
    "metrics.api",
    "multiprocessing",
    "multiprocessing.api",
    "multiprocessing.errors",
    "rendezvous",
    "rendezvous.api",
    "rendezvous.registry",
]

# Names torch's packages expose without meaning them (stdlib modules and typing names they import), and
# torch's health-check server, which torchdist does not provide (docs/design/elastic.md).
NOT_PUBLIC = {"Optional", "inspect", "logging", "os", "socket", "traceback", "health_check_server"}


def _public_names(module: types.ModuleType) -> set[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in dir(module) if not n.startswith("_")]
    return set(names) - NOT_PUBLIC


@pytest.mark.parametrize("path", MODULES)
def test_torch_public_names_import_from_torchdist(path):
    theirs = importlib.import_module(f"torch.distributed.elastic.{path}")
    ours = importlib.import_module(f"torchdist.elastic.{path}")
    missing = sorted(name for name in _public_names(theirs) if not hasattr(ours, name))
    assert not missing, f"torchdist.elastic.{path} lacks {missing}"


@pytest.mark.parametrize("path", ["agent.server.api", "multiprocessing", "rendezvous", "events.api", "metrics.api"])
def test_the_classes_keep_torchs_hierarchy_and_kinds(path):
    """A name that is a class (or a function) in torch is one in torchdist too, with the same public bases."""
    theirs = importlib.import_module(f"torch.distributed.elastic.{path}")
    ours = importlib.import_module(f"torchdist.elastic.{path}")
    for name in _public_names(theirs):
        a, b = getattr(theirs, name), getattr(ours, name)
        assert isinstance(a, type) == isinstance(b, type), name
        if isinstance(a, type):
            assert _public_bases(a) == _public_bases(b), name


def _public_bases(cls: type) -> list[str]:
    return [c.__name__ for c in cls.__mro__ if not c.__name__.startswith("_")]
