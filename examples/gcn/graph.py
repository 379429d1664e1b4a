"""The example's data: a seeded synthetic graph, cut into contiguous node ranges, and one rank's part.

Pure torch, no communication. Every rank builds the same whole graph from the seed and keeps its
part: that stands in for reading the partition file SAR's workers load (``load_dgl_partition_data``),
without DGL or a file on shared storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Graph", "GraphConfig", "LocalPart", "local_part", "partition_bounds", "synthetic_graph"]


@dataclass(frozen=True)
class GraphConfig:
    """A planted-partition (stochastic block model) graph: ``nodes`` nodes in ``classes`` blocks,
    about ``avg_degree`` neighbours per node of which a share ``homophily`` in the node's own block,
    Gaussian features around one centroid per class, and a random ``train_fraction`` of nodes
    labelled for training. The same ``seed`` gives the same graph on every rank and in every run."""

    nodes: int = 3000
    classes: int = 4
    features: int = 32
    avg_degree: int = 10
    homophily: float = 0.8
    train_fraction: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("nodes", "classes", "features", "avg_degree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1.")
        for name in ("homophily", "train_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value!r} must be in [0, 1].")


@dataclass(frozen=True)
class Graph:
    """An undirected graph without self loops: every edge is listed in both directions
    (``src[e] -> dst[e]``), so a node's in-degree is its degree."""

    num_nodes: int
    src: torch.Tensor  # int64, (E,)
    dst: torch.Tensor  # int64, (E,)
    features: torch.Tensor  # float32, (N, F)
    labels: torch.Tensor  # int64, (N,)
    train_mask: torch.Tensor  # bool, (N,)


def synthetic_graph(config: GraphConfig) -> Graph:
    """The graph ``config`` describes; deterministic (its own generator, not torch's global one)."""
    gen = torch.Generator().manual_seed(config.seed)
    n, k = config.nodes, config.classes
    # Classes are drawn per node, so node ids say nothing about classes and a contiguous range of
    # ids is a random sample of the graph: a partition with many cut edges, the halo's worst case.
    labels = torch.randint(k, (n,), generator=gen)

    # Undirected edges: a share `homophily` join a node to a random node of its own class, the rest
    # to any node. O(E) memory, unlike sampling a dense N x N matrix of block probabilities.
    m = n * config.avg_degree // 2
    m_same = round(m * config.homophily)
    u = torch.randint(n, (m,), generator=gen)
    by_class = torch.argsort(labels, stable=True)
    counts = torch.bincount(labels, minlength=k)
    starts = torch.cumsum(counts, 0) - counts
    pick = torch.rand(m_same, generator=gen, dtype=torch.float64)
    cls = labels[u[:m_same]]
    # Every u's class has at least u itself, so counts[cls] >= 1 and the index stays in range.
    same = by_class[starts[cls] + (pick * counts[cls]).long().clamp_max(counts[cls] - 1)]
    v = torch.cat([same, torch.randint(n, (m - m_same,), generator=gen)])
    keep = u != v
    a, b = torch.minimum(u, v)[keep], torch.maximum(u, v)[keep]
    pairs = torch.unique(a * n + b)  # drops repeated edges; sorted, hence deterministic
    a, b = pairs // n, pairs % n

    centroids = torch.randn(k, config.features, generator=gen)
    features = centroids[labels] + 1.5 * torch.randn(n, config.features, generator=gen)
    train_mask = torch.rand(n, generator=gen) < config.train_fraction
    return Graph(n, torch.cat([a, b]), torch.cat([b, a]), features, labels, train_mask)


def partition_bounds(num_nodes: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries: part ``r`` owns nodes ``bounds[r] <= v < bounds[r + 1]``.

    Contiguous ranges, as in SAR, whose partitions come from DGL's partitioner with nodes relabelled
    so that each partition's are contiguous; sizes differ by at most one node."""
    if parts < 1 or parts > num_nodes:
        raise ValueError(f"parts={parts} must be in 1..{num_nodes} (the number of nodes).")
    return [r * num_nodes // parts for r in range(parts + 1)]


@dataclass(frozen=True)
class LocalPart:
    """What one rank holds: its nodes, the edges into them, and which remote nodes it reads.

    Local nodes have indices ``0 .. num_local - 1`` (global id minus ``bounds[rank]``). Edge
    sources use an extended index: below ``num_local`` a local node, ``num_local + i`` the
    ``i``-th halo node. Halo nodes are sorted by global id, so those of one owner are consecutive
    and in rank order: ``halo_counts[r]`` of them belong to rank ``r`` (0 for this rank)."""

    rank: int
    bounds: list[int]
    src: torch.Tensor  # int64, extended index, (E_local,), self loops included
    dst: torch.Tensor  # int64, local index, (E_local,)
    halo_ids: torch.Tensor  # int64, global ids, sorted
    halo_counts: list[int]
    features: torch.Tensor
    labels: torch.Tensor
    train_mask: torch.Tensor

    @property
    def num_local(self) -> int:
        return self.bounds[self.rank + 1] - self.bounds[self.rank]

    def requests(self) -> list[torch.Tensor]:
        """Per owner rank, the halo rows this rank needs from it, as that owner's local indices."""
        per_owner = torch.split(self.halo_ids, self.halo_counts)
        return [ids - self.bounds[owner] for owner, ids in enumerate(per_owner)]


def local_part(graph: Graph, bounds: list[int], rank: int) -> LocalPart:
    """Rank ``rank``'s part: its nodes, every edge whose destination it owns (SAR's layout: a rank
    aggregates into its own nodes and reads remote sources), and a self loop per node (GCN's
    A + I)."""
    lo, hi = bounds[rank], bounds[rank + 1]
    inside = (graph.dst >= lo) & (graph.dst < hi)
    own = torch.arange(lo, hi)
    src = torch.cat([graph.src[inside], own])
    dst = torch.cat([graph.dst[inside], own]) - lo
    remote = (src < lo) | (src >= hi)
    halo_ids = torch.unique(src[remote])
    owners = torch.bucketize(halo_ids, torch.tensor(bounds), right=True) - 1
    halo_counts = torch.bincount(owners, minlength=len(bounds) - 1).tolist()
    ext = src - lo
    ext[remote] = (hi - lo) + torch.searchsorted(halo_ids, src[remote])
    return LocalPart(
        rank=rank,
        bounds=bounds,
        src=ext,
        dst=dst,
        halo_ids=halo_ids,
        halo_counts=[int(c) for c in halo_counts],
        features=graph.features[lo:hi],
        labels=graph.labels[lo:hi],
        train_mask=graph.train_mask[lo:hi],
    )
