"""etcd's size over a long churn of big job records, with the leader compacting and without.

For each retention (``--retentions``; 0 is compaction off, as an etcd without auto-compaction
and a coordinator with ``--etcd-compaction-retention 0`` are), a fresh one-member etcd on
loopback (no auto-compaction of its own, its default 2 GiB quota) and a real ``sar-coordinator``
on it run the same churn, ``--generations`` of tests/etcd_churn.py: jobs of 16 members whose hosts
report 24 interfaces of 32 random IPv6 addresses (~0.3 MB compressed records) join, leave one by
one (every leave rewrites the record) and re-form. Every ``--sample`` seconds it records the bytes
the coordinator sent etcd so far and etcd's database size (``etcdctl endpoint status``: the file
its quota counts). The table shows where each run ended, and how much the database grew over the
second half of the churn against what was sent meanwhile.

Run::

    python benchmarks/etcd_history.py --generations 60 --retentions 0,30 \\
        --json benchmarks/results/etcd_history.json --markdown benchmarks/results/etcd_history.md
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from harness import CoordinatorProcess
from recording import describe, write_results
from renderers import etcd_history as etcd_history_page

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.etcd_churn import HOSTS, INTERFACES, NoSpace, churn_generation, db_size, sent_to_etcd
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster


def run(retention: float, generations: int, sample: float, root: Path) -> dict[str, Any]:
    """One churn of ``generations`` with the coordinator's ``retention``; its samples."""
    cluster = EtcdCluster(root / f"etcd-{retention:g}", size=1)
    cluster.start()
    samples: list[dict[str, float]] = []
    stop = threading.Event()
    try:
        with CoordinatorProcess(
            root / f"coordinator-{retention:g}.log",
            store=cluster.url("bench"),
            flags=["--etcd-compaction-retention", f"{retention:g}", "--heartbeat-interval", "60",
                   "--reconnect-grace", "120", "--join-timeout", "120"],
        ) as coord, grpc.insecure_channel(coord.target) as channel:  # fmt: skip
            stub = pb_grpc.CoordinatorStub(channel)
            began_bytes, began = sent_to_etcd(cluster), time.monotonic()

            def look() -> None:
                while not stop.wait(sample):
                    samples.append(
                        {
                            "t_s": round(time.monotonic() - began, 1),
                            "sent_bytes": sent_to_etcd(cluster) - began_bytes,
                            "db_bytes": db_size(cluster),
                        }
                    )

            looker = threading.Thread(target=look, daemon=True)
            looker.start()
            generation, refused = 0, ""
            while generation < generations:
                generation += 1
                try:
                    churn_generation(stub, "churn", generation)
                except NoSpace as error:
                    refused = error.details
                    break
            stop.set()
            looker.join()
            return {
                "retention_s": retention,
                "generations": generation,
                "seconds": round(time.monotonic() - began, 1),
                "sent_bytes": sent_to_etcd(cluster) - began_bytes,
                "db_bytes": db_size(cluster),
                "refused": refused,
                "samples": samples,
            }
    finally:
        stop.set()
        cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=60, help="generations of the churn per run (60)")
    parser.add_argument("--retentions", default="0,30", help="--etcd-compaction-retention values (0,30)")
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between two samples (5)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    if ETCD_MISSING:
        print(f"etcd_history: {ETCD_MISSING}", file=sys.stderr)
        return 3
    with tempfile.TemporaryDirectory(prefix="etcd-history-") as scratch:
        results = [
            run(float(r), args.generations, args.sample, Path(scratch)) for r in args.retentions.split(",")
        ]
    doc = {
        "benchmark": "etcd_history",
        "command": shlex.join(["python", "benchmarks/etcd_history.py", *sys.argv[1:]]),
        "machine": describe("sarcomm", load_at="end"),
        "hosts": HOSTS,
        "interfaces": INTERFACES,
        "results": results,
    }
    write_results(doc, etcd_history_page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
