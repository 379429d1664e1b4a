"""Clean exits of self-registered ranks: ``multiprocessing`` children (as SAR's test suite starts
them) and :func:`sarcomm.worker.finalize`, against a real ``sar-coordinator`` process.

A fork (or forkserver) child ends with ``os._exit``, so no atexit hook runs there: its Leave comes
from the multiprocessing finalizer that registration installs. Each job below runs three real
children in gloo over loopback; the coordinator's ``/v1/jobs`` says how the job ended.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CoordinatorProcess

SCRIPT = Path(__file__).parent / "scripts" / "mp_children_job.py"
WORLD = 3
#: The script bounds its children at 90 s; this bounds the script itself.
RUN_DEADLINE_S = 120.0


def run_job(coord: CoordinatorProcess, method: str, mode: str, job: str) -> dict[str, Any]:
    """Run the job to its end and return its entry in the coordinator's ``/v1/jobs``."""
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), method, mode, str(WORLD), coord.grpc_target, job],
            capture_output=True,
            text=True,
            timeout=RUN_DEADLINE_S,
            env={"SARCOMM_HEARTBEAT_INTERVAL": "0.25", **_base_env()},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"the job did not end within {RUN_DEADLINE_S} s: {exc.stderr!r}; coordinator:\n{coord.log()}"
        )
    assert done.returncode == 0, f"{done.stderr[-4000:]}\ncoordinator:\n{coord.log()}"
    jobs = {j["job"]: j for j in coord.get_json("/v1/jobs")["jobs"]}  # type: ignore[index]
    found: dict[str, Any] = jobs[job]
    return found


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SAR_SOCKET_NAME", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_children_that_return_leave_and_the_job_finishes(
    coordinator: CoordinatorProcess, method: str
) -> None:
    job = run_job(coordinator, method, "return", f"mp-{method}")
    assert job["state"] == "FINISHED", job
    assert sorted(m["rank"] for m in job["members"]) == list(range(WORLD))
    assert {(m["state"], m["exit_code"], m["reason"]) for m in job["members"]} == {
        ("LEFT", 0, "exited with code 0")
    }


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_multiprocessing_child_that_raises_fails_the_job_with_its_reason(
    coordinator: CoordinatorProcess, method: str
) -> None:
    job = run_job(coordinator, method, "raise", f"mp-raise-{method}")
    assert job["state"] == "FAILED", job
    by_rank = {m["rank"]: m for m in job["members"]}
    assert (by_rank[1]["state"], by_rank[1]["exit_code"]) == ("FAILED", 1)
    assert "ValueError: rank 1 broke on purpose" in by_rank[1]["reason"]
    # The others returned normally and left with code 0 before or after it.
    assert {by_rank[r]["exit_code"] for r in (0, 2)} == {0}


def test_a_multiprocessing_child_that_calls_sys_exit_leaves_with_its_code(
    coordinator: CoordinatorProcess,
) -> None:
    job = run_job(coordinator, "fork", "exit3", "mp-exit3")
    assert job["state"] == "FAILED", job
    by_rank = {m["rank"]: m for m in job["members"]}
    assert (by_rank[1]["state"], by_rank[1]["exit_code"]) == ("FAILED", 3)
    assert 'exited with code 3 after KeyError: "rank 1\'s table"' in by_rank[1]["reason"]
    assert {by_rank[r]["exit_code"] for r in (0, 2)} == {0}


def test_finalize_leaves_once_and_the_job_finishes(coordinator: CoordinatorProcess) -> None:
    job = run_job(coordinator, "fork", "finalize", "mp-finalize")
    assert job["state"] == "FINISHED", job
    # The Leave came from finalize() (its reason), not from the exit hook, and only once.
    assert {(m["state"], m["exit_code"], m["reason"]) for m in job["members"]} == {("LEFT", 0, "finalize()")}
