"""Zero-code metrics, end to end: ranks that ``torchrun --rdzv-backend=sarcomm`` and ``sar-worker``
start run a DDP script that never imports sarcomm (``tests/scripts/zerocode_ddp.py``), and
still get per-collective metrics, a ``/metrics`` endpoint and a place in the coordinator's ``/sd``.

One coordinator, two jobs run side by side (to spend the torch start-up once):

- torchrun, two nodes x two gloo workers: node A's workers plain DDP, node B's DDP plus sarcomm's
  library (each all_reduce counted once);
- sar-worker, three gloo ranks: rank 0 plain (listed, counted), rank 1 with a malformed variable
  (its instrumentation fails: it trains on and says so in one line), rank 2 opted out with
  ``SAR_AUTO_METRICS=0`` (no endpoint, nothing loaded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import CoordinatorProcess
from tests.helpers import SAR_WORKER, wait_for, wait_for_sd
from tests.test_torchrun_sd import sample, scrape
from tests.torchrun_nodes import SLOW_S, TRAIN, Node, torchrun_args

pytestmark = pytest.mark.timeout(600)

SCRIPT = Path(__file__).resolve().parent / "scripts" / "zerocode_ddp.py"
STEPS = 6
FAILED_LINE = "zero-code metrics are off"


def _records(out: Path, ranks: int) -> dict[int, dict[str, Any]]:
    def written() -> dict[int, dict[str, Any]] | None:
        found = {}
        for path in out.glob("*.json"):
            try:
                record = json.loads(path.read_text())
            except json.JSONDecodeError:  # being written
                continue
            found[int(record["rank"])] = record
        return found if len(found) == ranks else None

    return wait_for(written, SLOW_S, what=f"{ranks} ranks to train under {out}", interval=0.2)


def _listening_ports(pid: int) -> set[int]:
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return set()
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}


def _check_scrape(target: str, record: dict[str, Any], job: str) -> None:
    """The endpoint counted at least the rank's all_reduces (its DDP steps' and 5 more), and they
    took less time than the steps and calls that made them."""
    text = scrape(target)
    rank = str(record["rank"])
    assert sample(text, "sar_worker_info", job=job, rank=rank, backend="gloo") == 1.0, text[:3000]
    labels = {"op": "all_reduce", "backend": "gloo"}
    count = sample(text, "sar_collective_duration_seconds_count", **labels)
    total = sample(text, "sar_collective_duration_seconds_sum", **labels)
    assert count is not None, f"rank {rank} recorded no all_reduce:\n{text[:3000]}"
    assert total is not None
    assert count >= record["steps"] + 5, f"rank {rank}: {count} all_reduces counted, {record['steps']} steps"
    assert 0 < total <= record["step_s"] + record["calls_s"], (rank, total, record)
    assert (sample(text, "sar_collective_bytes_total", **labels) or 0) > 0


def test_ddp_without_sarcomm_is_measured_under_torchrun_and_sar_worker(
    module_coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    coord = module_coordinator
    torchrun_out, worker_out = tmp_path / "torchrun", tmp_path / "sar-worker"
    torchrun_out.mkdir()
    worker_out.mkdir()
    nodes: list[Node] = []
    for name, extra in (("plain", []), ("library", ["--library"])):
        args = torchrun_args(coord.grpc_target, "zc-torchrun", torchrun_out, nnodes="2")
        at = args.index(str(TRAIN))
        args[at:] = [str(SCRIPT), str(torchrun_out), "--steps", str(STEPS), *extra]
        nodes.append(Node(name, args, tmp_path / f"{name}.log").start())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    agent = subprocess.Popen(
        [
            *SAR_WORKER, "--coord", coord.grpc_target, "--job", "zc-agent", "--world-size", "3",
            "--nproc-per-node", "3", "--backend", "gloo", "--heartbeat-interval", "0.25",
            "--join-timeout", "120", "--", sys.executable, str(SCRIPT), str(worker_out),
            "--steps", str(STEPS), "--break-rank", "1", "--optout-rank", "2",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        # torchrun: four endpoints, each a worker's own (never an agent's), each counting its
        # rank's DDP all_reduces; the library's ranks counted each all_reduce once.
        records = _records(torchrun_out, 4)
        assert all(r["ok"] for r in records.values()), records
        assert all(r["instrumented"] for r in records.values()), records
        library = [r for r in records.values() if "counted" in r]
        assert len(library) == 2, records
        assert all(r["counted"] == r["ran"] for r in library), library
        groups = wait_for_sd(coord.http_url, "zc-torchrun", 4, timeout=SLOW_S)
        agent_ports = set().union(*(_listening_ports(n.proc.pid) for n in nodes if n.proc is not None))
        for group in groups:
            record = records[int(group["labels"]["rank"])]
            (target,) = group["targets"]
            port = int(target.rsplit(":", 1)[1])
            assert port in _listening_ports(record["pid"]), (group, record)
            assert port not in agent_ports, (group, record)
            _check_scrape(target, record, "zc-torchrun")
        for node in nodes:
            assert FAILED_LINE not in node.log(), node.log()

        # sar-worker: rank 0 listed and counted, rank 1 failed and said so once, rank 2 opted out.
        ranks = _records(worker_out, 3)
        assert all(r["ok"] for r in ranks.values()), ranks
        assert [ranks[i]["instrumented"] for i in range(3)] == [True, False, False]
        (group,) = wait_for_sd(coord.http_url, "zc-agent", 1, timeout=SLOW_S)
        assert group["labels"]["rank"] == "0"
        _check_scrape(group["targets"][0], ranks[0], "zc-agent")
        assert not ranks[2]["loaded"], "an opted-out rank loads nothing of the instrumentation"
    finally:
        (torchrun_out / "stop").touch()
        (worker_out / "stop").touch()
    codes = [node.wait() for node in nodes]
    try:
        output, _ = agent.communicate(timeout=SLOW_S)
    finally:
        agent.kill()
        for node in nodes:
            node.stop()
    assert codes == [0, 0], "\n".join(n.log() for n in nodes)
    assert agent.returncode == 0, output
    failed = [line for line in output.splitlines() if FAILED_LINE in line]
    assert len(failed) == 1, output
    assert "SARCOMM_HEARTBEAT_INTERVAL" in failed[0], output
