"""Record size: how large one job's stored record is, and whether each store keeps it whole.

A job of N realistic members is formed through the real :class:`Membership`: hosts of
``--per-join`` members each (8: an agent per host with 8 local ranks; 1: a Join per rank, each with
its own join id), each host with ``lo``, ``eth0`` (an IPv4 and an IPv6 address, the default route)
and ``ib0`` (one IPv4 address), every member's metrics endpoint known and a heartbeat stamp set.
Its record (:func:`records.job_record`) is encoded as the coordinator encodes it
(:func:`store.encode_job`); per job the table gives the JSON, the whole record compressed (zlib 6,
as etcd's store compresses), and what etcd's store writes: the head and the member chunks (count,
largest, total). The largest request etcd takes by default is 1.5 MiB (``--max-request-bytes``).

With ``--stores``, the record is also written to and read back from each store (a SQLite file; a
real three-member etcd cluster, tests/etcd_cluster.py) and compared with what was written.

Run::

    python benchmarks/record_size.py --sizes 4096,32768,65536 --stores \\
        --json benchmarks/results/record_size.json --markdown benchmarks/results/record_size.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from recording import describe, write_results
from renderers import record_size as record_size_page
from renderers.record_size import RoundTrip, SizeRow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.coordinator.domain.membership import Job, JoinSpec, MemberRequest, Membership
from sarcomm.coordinator.ha.leadership import LeaderRecord
from sarcomm.coordinator.storage import etcd_client
from sarcomm.coordinator.storage.etcd_client import EtcdClient
from sarcomm.coordinator.storage.etcd_config import EtcdSettings
from sarcomm.coordinator.storage.etcd_store import MAX_CHUNK_BYTES, EtcdStore
from sarcomm.coordinator.storage.records import job_record
from sarcomm.coordinator.storage.store import SqliteStore, StateStore, encode_job
from tests.etcd_cluster import ETCD_MISSING, running_cluster

MIB = 1024 * 1024


def realistic_job(world: int, per_join: int) -> Job:
    """A formed job of ``world`` members, ``per_join`` per Join (one host each)."""
    membership = Membership(liveness_timeout=600.0)
    for host in range(world // per_join):
        ip = f"10.{host >> 16 & 255}.{host >> 8 & 255}.{host & 255}"
        interfaces = (
            InterfaceInfo("lo", ("127.0.0.1",), InterfaceKind.LOOPBACK),
            InterfaceInfo("eth0", (ip, f"fd00::{host:x}"), InterfaceKind.PHYSICAL, True),
            InterfaceInfo("ib0", (f"192.168.{host >> 8 & 255}.{host & 255}",), InterfaceKind.PHYSICAL),
        )
        spec = JoinSpec(
            job="big", world_size=world, host=f"node{host:05d}", interfaces=interfaces,
            members=tuple(MemberRequest(local_rank=i) for i in range(per_join)), store_port=29500,
            peer_address=ip,
        )  # fmt: skip
        membership.join(spec, join_id=f"join-{host}")
    job = membership.job("big")
    assert job is not None
    assert job.formed
    for member in job.members:
        member.metrics_address = f"{member.address}:{9400 + member.local_rank}"
        member.last_heartbeat = job.formed + 1.5
    return job


def measure(world: int, per_join: int) -> tuple[SizeRow, dict[str, Any]]:
    """The sizes of a job's record, and the record (to write to the stores)."""
    job = realistic_job(world, per_join)
    began = time.perf_counter()
    row = encode_job(job_record(job))
    encode_s = time.perf_counter() - began
    raw = row.record_json.encode()
    chunks = [len(zlib.compress(piece.encode(), 6)) for piece in row.pieces]
    sizes: SizeRow = {
        "members": world,
        "per_join": per_join,
        "json_bytes": len(raw),
        "zlib_bytes": len(zlib.compress(raw, 6)),
        "head_bytes": len(row.head),
        "chunks": len(chunks),
        "largest_chunk_bytes": max(chunks, default=0),
        "chunked_bytes": sum(chunks),
        "encode_s": round(encode_s, 3),
        "fits_one_request": len(zlib.compress(raw, 6)) <= 1.5 * MIB,
    }
    return sizes, job_record(job)


def round_trip(store: StateStore, record: dict[str, Any]) -> RoundTrip:
    began = time.perf_counter()
    store.write_rows([encode_job(record)])
    written = time.perf_counter()
    (loaded,) = store.load_jobs()
    read = time.perf_counter()
    if loaded != json.loads(json.dumps(record)):
        raise AssertionError("the record read back differs from the one written")
    return {"write_s": round(written - began, 3), "load_s": round(read - written, 3)}


def lead(client: EtcdClient, store: EtcdStore) -> None:
    lease, _ = client.grant(600)
    answer = client.txn(
        "campaign",
        [etcd_client.compare_create_revision(store.leader_key, 0)],
        [etcd_client.put(store.leader_key, LeaderRecord("bench:1", "bench").encode(), lease)],
    )
    store.fence(int(answer.header.revision))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="4096,32768,65536", help="members per job (default 4096,32768,65536)"
    )
    parser.add_argument("--per-join", default="8,1", help="members per Join (default 8,1)")
    parser.add_argument("--stores", action="store_true", help="also write and read back on SQLite and etcd")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write a Markdown table here")
    args = parser.parse_args()
    measured = [measure(int(n), int(k)) for n in args.sizes.split(",") for k in args.per_join.split(",")]
    rows = [row for row, _ in measured]
    if args.stores:
        with tempfile.TemporaryDirectory() as work:
            for i, (row, record) in enumerate(measured):
                sqlite = SqliteStore(Path(work) / f"state{i}.sqlite")
                row["sqlite"] = round_trip(sqlite, record)
                sqlite.close()
            if ETCD_MISSING:
                print(f"etcd skipped: {ETCD_MISSING}")
            else:
                with running_cluster(Path(work) / "etcd") as cluster:
                    for i, (row, record) in enumerate(measured):
                        client = EtcdClient(EtcdSettings(cluster.url(f"bench{i}")), timeout=30)
                        etcd = EtcdStore(client, f"/bench{i}")
                        lead(client, etcd)
                        row["etcd"] = round_trip(etcd, record)
                        client.close()
    doc = {
        "benchmark": "record_size",
        "command": shlex.join(["python", "benchmarks/record_size.py", *sys.argv[1:]]),
        "machine": describe(),
        "max_chunk_bytes": MAX_CHUNK_BYTES,
        "results": rows,
    }
    write_results(doc, record_size_page.section, args.json, args.markdown)


if __name__ == "__main__":
    main()
