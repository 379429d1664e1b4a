"""``--metrics-host`` / ``SAR_METRICS_HOST``: where a rank's ``/metrics`` endpoint listens, and the
address the coordinator lists for it in ``/sd``.

End to end with a real coordinator: a one-rank job under ``sar-worker --metrics-host 127.0.0.1``,
the same without the flag (every interface), and a self-registered rank with the variable. Each
rank scrapes itself on 127.0.0.1 and tries 127.0.0.2, another loopback address that only an
endpoint on every interface answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.launch_env import metrics_host, metrics_host_setting, metrics_report_host
from tests.conftest import CoordinatorProcess
from tests.helpers import SAR_WORKER

SCRIPT = str(Path(__file__).parent / "scripts" / "metrics_host_rank.py")
#: Bounds one run: torch import, rendezvous, the /sd wait (20 s at most).
RUN_DEADLINE_S = 90.0


def _env(coord: CoordinatorProcess, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    return {**env, "TEST_COORD_HTTP": coord.http_url, "SARCOMM_HEARTBEAT_INTERVAL": "0.25", **extra}


def _run(cmd: list[str], env: dict[str, str], out: Path, coord: CoordinatorProcess) -> dict[str, Any]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_DEADLINE_S, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"still running after {RUN_DEADLINE_S} s: {exc.stderr!r}\ncoordinator:\n{coord.log()}")
    assert done.returncode == 0, f"{done.stderr[-4000:]}\ncoordinator:\n{coord.log()}"
    seen: dict[str, Any] = json.loads(out.read_text())
    return seen


def _agent(coord: CoordinatorProcess, job: str, out: Path, *flags: str) -> dict[str, Any]:
    cmd = [
        *SAR_WORKER, "--coord", coord.grpc_target, "--job", job,
        "--world-size", "1", "--backend", "gloo", "--heartbeat-interval", "0.25", *flags,
        "--", sys.executable, SCRIPT, "agent", str(out), job,
    ]  # fmt: skip
    return _run(cmd, _env(coord), out, coord)


def test_sar_worker_metrics_host_binds_only_that_address(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    seen = _agent(coordinator, "mh", tmp_path / "mh.json", "--metrics-host", "127.0.0.1")
    assert seen["scraped"] is True
    assert seen["other"] == "refused"
    # /sd lists the address it listens on (an address of its host, which the coordinator accepts).
    assert [g["targets"] for g in seen["sd"]] == [[f"127.0.0.1:{seen['port']}"]]


def test_without_metrics_host_the_endpoint_listens_on_every_interface(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    seen = _agent(coordinator, "all", tmp_path / "all.json")
    assert (seen["scraped"], seen["other"]) == (True, "connected")
    assert [g["targets"] for g in seen["sd"]] == [[f"127.0.0.1:{seen['port']}"]]


def test_self_registered_rank_honours_sar_metrics_host(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    out = tmp_path / "self.json"
    cmd = [sys.executable, SCRIPT, "self", str(out), "selfmh", coordinator.grpc_target]
    seen = _run(cmd, _env(coordinator, SAR_METRICS_HOST="127.0.0.1", SAR_SOCKET_NAME="lo"), out, coordinator)
    assert (seen["scraped"], seen["other"]) == (True, "refused")
    assert [g["targets"] for g in seen["sd"]] == [[f"127.0.0.1:{seen['port']}"]]


def test_metrics_host_takes_ip_addresses_only() -> None:
    assert metrics_host(" 127.0.0.1 ", "--metrics-host") == "127.0.0.1"
    assert metrics_host("0:0::1", "--metrics-host") == "::1"
    assert metrics_host("", "--metrics-host") == ""
    with pytest.raises(
        InvalidArgumentError,
        match=r"^SAR_METRICS_HOST='head' must be an IP address of this host to serve /metrics on "
        r"\(e\.g\. 127\.0\.0\.1; 0\.0\.0\.0 or unset: every interface\)\.$",
    ):
        metrics_host_setting({"SAR_METRICS_HOST": "head"})
    assert metrics_host_setting({}) == "0.0.0.0"


def test_the_reported_host_is_the_bound_one_unless_it_is_a_wildcard() -> None:
    assert metrics_report_host("127.0.0.1", "10.0.0.5") == "127.0.0.1"
    assert metrics_report_host("0.0.0.0", "10.0.0.5") == "10.0.0.5"
    assert metrics_report_host("::", "10.0.0.5") == "10.0.0.5"
    assert metrics_report_host("", "10.0.0.5") == "10.0.0.5"
