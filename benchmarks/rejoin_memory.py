"""Memory an elastic job keeps over many re-rendezvous, in process (the membership domain, a fake
clock): the join ids (resent-Join tickets) the coordinator holds and the Python heap it grows by.

A torchrun job of NODES nodes forms (each node's Join with its own join id, as the client sends
it), then re-forms ROUNDS times: every node re-joins with its member of the running generation and
a fresh join id, which ends that generation as a re-rendezvous (JOB_RESTARTING) and forms the next.
Each ticket holds its members' secrets and its whole generation (its ``Job``), so one kept past its
generation keeps that generation alive. Printed: the join ids held and the traced heap after the
first re-rendezvous and after the last (tracemalloc, after a full collection), one JSON line.

Runs against whichever sarcomm is importable, so the same script compares two trees:

    python benchmarks/rejoin_memory.py --rounds 1000
    git archive 1f979d0 | tar -x -C /tmp/base && (cd /tmp/base && bash scripts/linktree.sh)
    PYTHONPATH=/tmp/base/build/pkgtree python benchmarks/rejoin_memory.py --rounds 1000
"""

from __future__ import annotations

import argparse
import gc
import json
import tracemalloc
from typing import Any

from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.coordinator.domain.membership import JoinSpec, MemberRequest, Membership, Ticket
from sarcomm.coordinator.domain.model import ElasticRange

LOOPBACK = (InterfaceInfo("lo", ("127.0.0.1",), InterfaceKind.LOOPBACK),)


class Clock:
    """The coordinator's clocks, standing still (nothing here waits)."""

    def monotonic(self) -> float:
        return 1000.0

    def wall(self) -> float:
        return 1_700_000_000.0


def node_join(host: str, nodes: int, rejoin: Ticket | None) -> JoinSpec:
    """Node ``host``'s Join of the job (one member, --nnodes NODES:NODES)."""
    member = rejoin.members[0] if rejoin is not None else None
    return JoinSpec(
        job="long-elastic",
        world_size=nodes,
        host=host,
        interfaces=LOOPBACK,
        store_port=29500,
        members=(MemberRequest(local_rank=0),),
        elastic=ElasticRange(nodes, nodes, 0.0),
        rejoin_member_id=member.member_id if member is not None else "",
        rejoin_secret=rejoin.secrets[0] if rejoin is not None else "",
    )


def measure(nodes: int, rounds: int) -> dict[str, Any]:
    membership = Membership(liveness_timeout=3.0, clock=Clock())
    counter = iter(range(10**9))
    hosts = [f"node{i}" for i in range(nodes)]
    tickets = [membership.join(node_join(h, nodes, None), f"{next(counter):032x}") for h in hosts]
    samples: dict[str, Any] = {}
    tracemalloc.start()
    for done in range(1, rounds + 1):
        tickets = [
            membership.join(node_join(h, nodes, t), f"{next(counter):032x}")
            for h, t in zip(hosts, tickets, strict=True)
        ]
        assert tickets[0].job.generation == done + 1, tickets[0].job.generation
        if done in (1, rounds):
            gc.collect()
            held = len(membership._join_ids._entries)
            samples[f"after_{done}"] = {"join_ids": held, "heap_bytes": tracemalloc.get_traced_memory()[0]}
    tracemalloc.stop()
    first, last = samples["after_1"], samples[f"after_{rounds}"]
    return {
        "nodes": nodes,
        "rounds": rounds,
        **samples,
        "growth_bytes": last["heap_bytes"] - first["heap_bytes"],
        "growth_per_round_bytes": (last["heap_bytes"] - first["heap_bytes"]) / max(1, rounds - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1000)
    args = parser.parse_args()
    print(json.dumps(measure(args.nodes, args.rounds)))


if __name__ == "__main__":
    main()
