"""Train a digit classifier with FSDP2's ``fully_shard``: each rank stores only its shard of every parameter.

The data set is scikit-learn's bundled ``digits`` (nothing is downloaded). The
model's layers are sharded one by one, then the root; the optimizer steps on
the sharded DTensor parameters, so each rank also keeps only its shard of the
AdamW state. Rank 0 prints per-epoch loss and accuracy, and how many parameter
elements this rank stores against the model's total.

    pip install scikit-learn                # or: pip install -e .[examples]
    torchdist-run --nproc-per-node 2 examples/fsdp_digits.py --epochs 10

Add ``--bf16`` for mixed precision (bfloat16 compute, float32 gradient
reduction). Expected result: a test accuracy of about 0.97 after 10 epochs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchdist as dist
from torchdist.fsdp import MixedPrecisionPolicy, fully_shard
from torchdist.utils.data import DistributedSampler


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """(train, test) TensorDatasets of the digits, split the same way on every rank."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    return TensorDataset(x[order[n_test:]], y[order[n_test:]]), TensorDataset(x[order[:n_test]], y[order[:n_test]])


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 128), nn.Linear(128, 64)])
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    return (model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 gradient reduction")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every rank starts from the same full model, then keeps its shard
    model = Classifier()
    total = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    stored = sum(p.to_local().numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    train, test = load_digits_split()
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    if rank == 0:
        print(f"{world} ranks; rank 0 stores {stored} of {total} parameter elements")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total_loss = torch.zeros(())
        for x, y in loader:
            loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total_loss += loss.detach()
        dist.all_reduce(total_loss, op=dist.ReduceOp.AVG)
        accuracy = evaluate(model, test)  # a forward: every rank takes part in the all-gathers
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {total_loss.item() / len(loader):.4f}, test accuracy {accuracy:.3f}")
    full = {name: value.full_tensor() for name, value in model.state_dict().items()}  # collective: all ranks
    if rank == 0:
        print(f"full state dict: {sum(v.numel() for v in full.values())} elements, "
              f"keys {sorted(full)[:2]}...")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
