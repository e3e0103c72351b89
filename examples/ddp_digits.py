"""Train a digit classifier with DistributedDataParallel: torchdist's main job.

The data set is scikit-learn's bundled ``digits`` (1,797 8x8 images, shipped
inside the package: nothing is downloaded). Every rank holds a replica of the
model and reads its own share of each epoch through ``DistributedSampler``;
DDP averages the gradients during backward, so the replicas stay identical.
Rank 0 shows a progress bar, prints per-epoch loss and accuracy, and saves a
checkpoint after every epoch; ``--resume`` continues from it.

    pip install scikit-learn tqdm          # or: pip install -e .[examples]
    torchdist-run --nproc-per-node 2 examples/ddp_digits.py --epochs 15
    torchdist-run --nproc-per-node 2 examples/ddp_digits.py --epochs 20 --resume

On a cluster that runs MPI, ``mpiexec -n 2 python examples/ddp_digits.py --backend mpi``
(rank and world size then come from MPI). Any launcher that sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT works, except ``torchrun``: its agent serves MASTER_PORT with PyTorch's own store,
which a torchdist program cannot use (it says so within seconds). Expected
result: a test accuracy of about 0.97 after 15 epochs, the same on every rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchdist as dist
from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist.utils.data import DistributedSampler


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """(train, test) TensorDatasets of the digits, split the same way on every rank."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", default="ddp_digits.pt")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--backend", default="gloo",
                        help="gloo (the default CPU backend, with env://) or mpi (under mpiexec)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)  # gloo: env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); mpi: MPI
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train, test = load_digits_split()

    torch.manual_seed(rank)  # different on purpose: DDP's constructor broadcasts rank 0's parameters
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_epoch = 0
    if args.resume and os.path.exists(args.checkpoint):
        checkpoint = torch.load(args.checkpoint, map_location="cpu")
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.checkpoint} after epoch {checkpoint['epoch'] + 1}")
    elif args.resume and rank == 0:
        print(f"no checkpoint at {args.checkpoint}: starting from scratch")

    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    if rank == 0:
        print(f"digits: {len(train)} training / {len(test)} test images, {world_size} ranks, "
              f"{len(loader)} batches of {args.batch_size} per rank and epoch")
    show_bar = rank == 0 and not args.no_progress
    if show_bar:
        from tqdm import tqdm

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        totals = torch.zeros(3)  # loss sum, correct, samples
        batches = tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False) if show_bar else loader
        for x, y in batches:
            optimizer.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()  # gradients are averaged across ranks here
            optimizer.step()
            totals += torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)])
        dist.all_reduce(totals)  # the whole epoch, over all ranks
        test_accuracy = evaluate(model.module, test)
        if rank == 0:
            print(f"epoch {epoch + 1:3d}  loss {totals[0] / totals[2]:.4f}  train acc {totals[1] / totals[2]:.4f}  "
                  f"test acc {test_accuracy:.4f}")
            # written aside, then renamed: an interrupted save never leaves half a checkpoint
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
        dist.barrier()  # the checkpoint is complete before anyone may read it

    final = torch.tensor([evaluate(model.module, test)])
    replicas = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(replicas, final)
    if rank == 0:
        same = all(torch.equal(r, final) for r in replicas)
        print(f"final test accuracy: {final.item():.4f} (identical on all {world_size} ranks: {same}); "
              f"checkpoint: {args.checkpoint}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
