"""The shipped systemd units verify, and the coordinator speaks the readiness protocol they rely on.

``systemd-analyze verify`` reads the units as systemd would (sections, keys, values, that the
command exists and is executable) without a running systemd. The readiness test is a real
coordinator process given a ``NOTIFY_SOCKET`` that the test listens on, as systemd does for
``Type=notify`` units.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CoordinatorProcess
from tests.helpers import free_port

UNITS = Path(__file__).resolve().parent.parent / "deploy" / "systemd"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
#: The install prefix the shipped units name (a virtual environment at /opt/sarcomm).
SHIPPED_BIN = "/opt/sarcomm/bin"
NOTIFY_DEADLINE_S = 20.0

needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="needs systemd-analyze (Debian: apt-get install systemd)"
)


def installed(unit: Path, directory: Path, name: str | None = None) -> Path:
    """``unit`` as a user installs it: ExecStart pointing at this environment's sarcomm commands."""
    text = unit.read_text()
    assert SHIPPED_BIN in text, f"{unit.name} no longer names {SHIPPED_BIN}: update this test"
    target = directory / (name or unit.name)
    target.write_text(text.replace(SHIPPED_BIN, str(Path(sys.executable).parent)))
    return target


def verify(*units: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *(str(u) for u in units)],
        capture_output=True, text=True, timeout=60, cwd=units[0].parent,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )  # fmt: skip


@pytest.mark.integration  # systemd-analyze
@needs_systemd_analyze
def test_the_coordinator_unit_and_an_agent_instance_verify_without_a_warning(tmp_path: Path) -> None:
    coordinator = installed(UNITS / "sar-coordinator.service", tmp_path)
    installed(UNITS / "sar-worker@.service", tmp_path)
    agent = installed(UNITS / "sar-worker@.service", tmp_path, "sar-worker@gnn.service")
    result = verify(coordinator, agent)
    # verify exits 0 for unknown keys and values it ignores; a clean unit prints nothing at all.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.integration  # systemd-analyze
@needs_systemd_analyze
def test_verify_catches_a_unit_systemd_would_ignore_a_line_of(tmp_path: Path) -> None:
    # The check above means something: a misspelt key is reported.
    unit = installed(UNITS / "sar-coordinator.service", tmp_path)
    unit.write_text(unit.read_text().replace("Restart=on-failure", "Restartt=on-failure"))
    result = verify(unit)
    assert "Unknown key 'Restartt'" in result.stdout + result.stderr


def test_the_coordinator_unit_is_notify_typed_and_stops_within_its_grace() -> None:
    text = (UNITS / "sar-coordinator.service").read_text()
    for line in ("Type=notify", "Restart=on-failure", "StateDirectory=sarcomm", "KillSignal=SIGTERM"):
        assert f"\n{line}\n" in text, line
    # systemd waits longer than the coordinator's in-flight grace (5 s) before SIGKILL.
    assert "\nTimeoutStopSec=30\n" in text


@pytest.mark.integration  # a sar-coordinator process
def test_the_coordinator_notifies_ready_once_it_serves_and_stopping_on_sigterm(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    listener.bind(str(path))
    listener.settimeout(NOTIFY_DEADLINE_S)
    coord = CoordinatorProcess(
        grpc_port=free_port(), http_port=free_port(), state_path=tmp_path / "state.sqlite", args=[],
        log_path=tmp_path / "coordinator.log", env={"NOTIFY_SOCKET": str(path)},
    )  # fmt: skip
    try:
        coord.start()
        ready = listener.recv(4096).decode()
        assert ready.splitlines()[0] == "READY=1", ready
        assert f"gRPC on port {coord.grpc_port}, HTTP on port {coord.http_port}" in ready
        assert coord.proc is not None
        coord.proc.send_signal(signal.SIGTERM)
        stopping = listener.recv(4096).decode()
        assert stopping.splitlines()[0] == "STOPPING=1", stopping
        assert coord.proc.wait(NOTIFY_DEADLINE_S) == 0, coord.log()
    finally:
        coord.stop()
        listener.close()
