"""Full-batch GCN training on a partitioned graph, in SAR's style, started through ``sar-worker``.

Each rank owns a contiguous range of a seeded synthetic graph's nodes and the edges into them.
Per layer it fetches the feature rows of remote neighbours (the halo) with ``exchange_tensors``;
the backward pass sends their gradients back to the owners; ``gather_grads`` sums the parameter
gradients over ranks. The loss is the global training set's mean cross-entropy, so every rank takes
exactly the step that training on the whole graph in one process takes (``--single``).

Run on 4 ranks, 2 per agent (start a coordinator first: ``sar-coordinator --listen
127.0.0.1:50051``, then each of these, e.g. in two terminals)::

    sar-worker --coord 127.0.0.1:50051 --job gcn --world-size 4 --nproc-per-node 2 -- \
        python examples/gcn/train.py --epochs 5

The same model trained on the whole graph in this one process, for comparison::

    python examples/gcn/train.py --single --epochs 5

``--out PATH`` writes (from rank 0) a ``torch.save`` dict: ``losses`` and ``accuracy`` per epoch,
the final ``params``, ``world_size`` and ``parts`` (per rank: nodes, edges, halo rows, rows sent).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sarcomm.worker as sar
from sarcomm.worker.library.comm import destroy_comms

# isort: split
# This example's own modules: python puts examples/gcn/ (the script's folder) on sys.path.
from graph import Graph, GraphConfig, local_part, partition_bounds, synthetic_graph
from halo import make_plan, make_propagate

Propagate = Callable[[torch.Tensor], torch.Tensor]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


class GCNLayer(nn.Module):
    """``propagate(h W) + b``. The weight is applied before aggregating because it narrows the
    rows (features -> hidden -> classes), so each halo exchange moves fewer columns, as DGL's
    GraphConv does when ``in > out``; it also makes every exchange carry a gradient."""

    def __init__(self, fan_in: int, fan_out: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(nn.init.xavier_uniform_(torch.empty(fan_in, fan_out, dtype=dtype)))
        self.bias = nn.Parameter(torch.zeros(fan_out, dtype=dtype))

    def forward(self, h: torch.Tensor, propagate: Propagate) -> torch.Tensor:
        return propagate(h @ self.weight) + self.bias


class GCN(nn.Module):
    """Two GCN layers with a ReLU between (Kipf and Welling), no dropout so runs are comparable."""

    def __init__(self, features: int, hidden: int, classes: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv1 = GCNLayer(features, hidden, dtype)
        self.conv2 = GCNLayer(hidden, classes, dtype)

    def forward(self, x: torch.Tensor, propagate: Propagate) -> torch.Tensor:
        logits: torch.Tensor = self.conv2(torch.relu(self.conv1(x, propagate)), propagate)
        return logits


def build_model(args: argparse.Namespace, config: GraphConfig) -> GCN:
    # Seeded here, so the initial weights do not depend on what drew random numbers before.
    torch.manual_seed(args.seed)
    return GCN(config.features, args.hidden, config.classes, DTYPES[args.dtype])


def make_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    return torch.optim.Adam(model.parameters(), lr=args.lr)


def graph_config(args: argparse.Namespace) -> GraphConfig:
    return GraphConfig(
        nodes=args.nodes,
        classes=args.classes,
        features=args.features,
        avg_degree=args.avg_degree,
        homophily=args.homophily,
        train_fraction=args.train_fraction,
        seed=args.seed,
    )


def single_process_propagate(graph: Graph, dtype: torch.dtype) -> Propagate:
    """The textbook form, independent of the partitioned code: one sparse ``D^-1/2 (A+I) D^-1/2``."""
    n = graph.num_nodes
    loops = torch.arange(n)
    src, dst = torch.cat([graph.src, loops]), torch.cat([graph.dst, loops])
    degree = torch.bincount(dst, minlength=n).to(dtype)
    norm = (degree[src] * degree[dst]).rsqrt()
    adj = torch.sparse_coo_tensor(torch.stack([dst, src]), norm, (n, n), check_invariants=True).coalesce()
    return lambda h: torch.sparse.mm(adj, h)


def train_single(args: argparse.Namespace) -> dict[str, object]:
    """Train on the whole graph in this process; returns what ``--out`` saves."""
    config = graph_config(args)
    graph = synthetic_graph(config)
    dtype = DTYPES[args.dtype]
    propagate = single_process_propagate(graph, dtype)
    model = build_model(args, config)
    optimizer = make_optimizer(args, model)
    x, labels, mask = graph.features.to(dtype), graph.labels, graph.train_mask
    losses, accuracy = [], []
    for epoch in range(1, args.epochs + 1):
        optimizer.zero_grad()
        logits = model(x, propagate)
        loss = F.cross_entropy(logits[mask], labels[mask])
        torch.autograd.backward(loss)  # loss.backward(), which torch leaves untyped
        optimizer.step()
        correct = (logits[mask].argmax(1) == labels[mask]).sum().item()
        losses.append(loss.item())
        accuracy.append(correct / int(mask.sum()))
        print(f"epoch {epoch:3d}  loss {losses[-1]:.6f}  train accuracy {accuracy[-1]:.4f}", flush=True)
    parts = torch.tensor([[graph.num_nodes, len(graph.src) + graph.num_nodes, 0, 0]])
    return result(model, losses, accuracy, world_size=1, parts=parts)


def train_distributed(args: argparse.Namespace) -> dict[str, object] | None:
    """Train on this rank's partition; returns what ``--out`` saves on rank 0, None elsewhere."""
    info = sar.init()  # under sar-worker: rank, world and master from its environment
    rank, world = info.rank, info.world_size
    # Ranks sharing a host share its cores; without this each would start one thread per core.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))

    config = graph_config(args)
    part = local_part(synthetic_graph(config), partition_bounds(config.nodes, world), rank)
    dtype = DTYPES[args.dtype]
    plan = make_plan(part)
    propagate = make_propagate(part, plan, dtype)
    print(
        f"rank {rank}/{world}: nodes {part.bounds[rank]}..{part.bounds[rank + 1] - 1}, "
        f"{len(part.dst)} edges, halo rows from ranks {part.halo_counts}, rows sent {plan.send_counts}",
        flush=True,
    )

    model = build_model(args, config)
    sar.sync_params(model)  # rank 0's initial weights everywhere, as SAR does
    optimizer = make_optimizer(args, model)
    x, labels, mask = part.features.to(dtype), part.labels, part.train_mask
    # Sum of the local losses divided by the global count = the global mean, so the summed
    # gradients are those of single-process training.
    num_train = torch.tensor([int(mask.sum())], dtype=torch.int64)
    sar.all_reduce(num_train)
    total_train = int(num_train.item())
    losses, accuracy = [], []
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        optimizer.zero_grad()
        logits = model(x, propagate)
        loss = F.cross_entropy(logits[mask], labels[mask], reduction="sum") / total_train
        torch.autograd.backward(loss)  # halo gradients go back to their owners inside
        sar.gather_grads(model)  # sum over ranks
        optimizer.step()
        stats = torch.stack([loss.detach(), (logits[mask].argmax(1) == labels[mask]).sum().to(loss.dtype)])
        sar.all_reduce(stats)
        losses.append(stats[0].item())
        accuracy.append(stats[1].item() / total_train)
        if rank == 0:
            print(
                f"epoch {epoch:3d}  loss {losses[-1]:.6f}  train accuracy {accuracy[-1]:.4f}  "
                f"({time.perf_counter() - started:.3f} s)",
                flush=True,
            )

    mine = torch.tensor([part.num_local, len(part.dst), sum(part.halo_counts), sum(plan.send_counts)])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    sar.all_gather(gathered, mine)
    out = None
    if rank == 0:
        out = result(model, losses, accuracy, world_size=world, parts=torch.stack(gathered))
    sar.barrier()  # nobody tears the group down while a peer still talks to it
    destroy_comms()
    return out


def result(
    model: nn.Module, losses: list[float], accuracy: list[float], *, world_size: int, parts: torch.Tensor
) -> dict[str, object]:
    return {
        "world_size": world_size,
        "losses": torch.tensor(losses, dtype=torch.float64),
        "accuracy": torch.tensor(accuracy, dtype=torch.float64),
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "parts": parts,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", action="store_true", help="train on the whole graph in this process")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--nodes", type=int, default=GraphConfig.nodes)
    parser.add_argument("--classes", type=int, default=GraphConfig.classes)
    parser.add_argument("--features", type=int, default=GraphConfig.features)
    parser.add_argument("--avg-degree", type=int, default=GraphConfig.avg_degree)
    parser.add_argument("--homophily", type=float, default=GraphConfig.homophily)
    parser.add_argument("--train-fraction", type=float, default=GraphConfig.train_fraction)
    parser.add_argument("--seed", type=int, default=0, help="graph and initial weights (default 0)")
    parser.add_argument("--out", type=Path, help="write losses and final parameters here (torch.save)")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.hidden < 1:
        parser.error(f"--epochs {args.epochs} and --hidden {args.hidden} must be >= 1.")
    try:
        graph_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    saved = train_single(args) if args.single else train_distributed(args)
    if saved is not None and args.out is not None:
        torch.save(saved, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
