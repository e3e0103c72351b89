"""The package's promises about itself: thin public front, no torch.distributed, layers import downward."""

import ast
import pathlib

import pytest
import torch

import torchdist

PACKAGE = pathlib.Path(torchdist.__file__).parent

# Which internal layers each layer may import (STYLE.md: imports go only downward).
ALLOWED_INTERNAL_IMPORTS = {
    "_store": {"errors", "_auth", "_store"},
    "_transport": {"errors", "_auth", "_store", "_transport"},
    "_algorithms": {"errors", "_transport", "_algorithms"},
    "_process_group": {"errors", "_store", "_transport", "_algorithms", "_process_group"},
    "_c10d": {"errors", "_store", "_process_group", "_c10d"},
    "distributed_c10d": {"errors", "_store", "_process_group", "_c10d"},  # PyTorch's module path of the c10d API
    "symmetric_memory": {"errors", "_c10d", "_process_group"},
    "device_mesh": {"errors", "_c10d", "_process_group", "device_mesh"},
    # DTensor, and what is built on it: FSDP2's fully_shard, tensor parallelism, checkpoints of sharded states.
    "tensor": {"errors", "_c10d", "_process_group", "device_mesh", "tensor"},
    "fsdp": {"errors", "_c10d", "_process_group", "device_mesh", "tensor", "fsdp"},
    "checkpoint": {"errors", "_c10d", "_process_group", "device_mesh", "tensor", "fsdp", "checkpoint"},
    "pipelining": {"errors", "_c10d", "_process_group", "pipelining"},
    # DDP averages gradients in a distributed autograd context too, as PyTorch's reducer does.
    "_ddp": {"errors", "_algorithms", "_c10d", "_process_group", "autograd", "_ddp"},
    "algorithms": {"errors", "_c10d", "_process_group", "_ddp", "algorithms"},
    "nn": {"errors", "_c10d", "_process_group", "_ddp", "algorithms", "rpc", "nn"},  # RemoteModule runs on RPC
    "utils": {"errors", "_c10d", "utils"},
    # RPC and distributed autograd are one layer, as in PyTorch: RPC records the
    # autograd edges of the tensors it carries, and backward travels as RPCs.
    "rpc": {"errors", "_auth", "_store", "_transport", "autograd", "rpc"},
    "autograd": {"errors", "rpc", "autograd"},
    "optim": {"errors", "_c10d", "_process_group", "_ddp", "algorithms", "autograd", "rpc", "optim"},
    "elastic": {"errors", "_auth", "_store", "elastic"},
    "run": {"elastic"},
    "testing": {"errors", "testing"},
    "bench": {"testing", "bench"},
    # PyTorch keeps the DDP hooks that step a ZeroRedundancyOptimizer under algorithms/, but they join DDP (nn)
    # and the optimizer's internals (optim): a layer of their own, above both.
    "ddp_zero_hook": {"errors", "_c10d", "_ddp", "algorithms", "nn", "optim"},
}
#: Files that sit in another layer than their folder's.
LAYER_OF_FILE = {"algorithms/ddp_comm_hooks/ddp_zero_hook.py": "ddp_zero_hook"}


def _python_files():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_modules(path: pathlib.Path):
    """Absolute module names imported by ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package_parts = ["torchdist", *path.relative_to(PACKAGE).parent.parts]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module
            for alias in node.names:  # "from torch import distributed"
                yield f"{module}.{alias.name}"


def test_package_never_imports_torch_distributed():
    offenders = [
        f"{path.relative_to(PACKAGE)}: {module}"
        for path in _python_files()
        for module in _imported_modules(path)
        if module == "torch.distributed" or module.startswith("torch.distributed.")
    ]
    assert not offenders, offenders


def test_layers_import_only_downward():
    violations = []
    for path in _python_files():
        relative = path.relative_to(PACKAGE)
        layer = LAYER_OF_FILE.get(relative.as_posix(), relative.parts[0].removesuffix(".py"))
        if layer in ("__init__", "__main__", "errors", "_auth"):  # the front, and what every layer may use
            continue
        allowed = ALLOWED_INTERNAL_IMPORTS[layer]  # a new layer must say where it sits
        for module in _imported_modules(path):
            parts = module.split(".")
            if parts[0] == "torchdist" and len(parts) > 1 and parts[1] not in allowed:
                violations.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not violations, violations


def test_public_front_only_reexports():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert not defined, f"torchdist/__init__.py should only re-export, but defines {defined}"
    for name in torchdist.__all__:
        assert hasattr(torchdist, name), name


@pytest.mark.parametrize(
    "name",
    [
        # the c10d surface that torchdist implements so far; grows with each issue
        "init_process_group", "destroy_process_group", "is_initialized", "is_available",
        "is_torchelastic_launched", "get_rank", "get_world_size", "get_backend", "get_node_local_rank",
        "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group", "shrink_group", "get_global_rank",
        "get_group_rank", "get_process_group_ranks", "GroupMember", "group", "Backend", "BackendConfig",
        "ReduceOp", "reduce_op", "Work", "ProcessGroup", "Store", "TCPStore", "FileStore", "HashStore",
        "PrefixStore", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "QueueEmptyError",
        "broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_into_tensor",
        "all_gather_single", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
        "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier",
        "monitored_barrier", "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv",
        "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
        "send_object_list", "recv_object_list", "rendezvous", "register_rendezvous_handler",
        "is_backend_available", "default_pg_timeout", "is_gloo_available", "is_nccl_available", "is_mpi_available",
        "is_ucc_available", "is_xccl_available", "get_default_backend_for_device",
        "DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env",
    ],
)
def test_torch_distributed_name_is_exported(name):
    import torch.distributed

    assert name in torchdist.__all__
    if name in ("all_gather_single", "reduce_scatter_single") and torch.__version__ < "2.13":
        pytest.skip(f"{name} is new in torch 2.13 (this is {torch.__version__})")  # the suite may run on older torch
    assert hasattr(torch.distributed, name), f"{name} is not a torch.distributed name"


def test_rpc_constants_and_autograd_names_match_pytorchs():
    import torch.distributed.autograd as torch_autograd
    import torch.distributed.rpc.constants as torch_constants

    import torchdist.autograd as dist_autograd
    import torchdist.rpc.constants as constants

    for name in constants.__all__:
        assert getattr(constants, name) == getattr(torch_constants, name), name
    for name in ("context", "backward", "get_gradients", "is_available", "DistAutogradContext"):
        assert hasattr(torch_autograd, name) and name in dist_autograd.__all__, name
    assert dist_autograd.is_available()


def test_error_classes_have_pytorchs_bases():
    assert issubclass(torchdist.DistError, RuntimeError)
    for cls in (torchdist.DistBackendError, torchdist.DistNetworkError, torchdist.DistStoreError):
        assert cls.__bases__ == (torchdist.DistError,)
    assert torchdist.QueueEmptyError.__bases__ == (torchdist.DistStoreError,)
