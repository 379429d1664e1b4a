"""``sar-worker`` and ``sar-coordinator status`` say within seconds what is wrong with an address
they cannot use, and a waiting join keeps saying it at a bounded rate.

Real processes: a port nothing listens on, a name under ``.invalid`` (never resolves), and the
coordinator's own HTTP port (something answers, but not gRPC).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.constants import JOIN_ANSWER_SLACK_S
from tests.conftest import CoordinatorProcess
from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.integration

#: "Within seconds": the probe runs once a second while the channel fails; start-up included.
SAY_S = 10.0
#: How often a waiting join repeats itself (channel._STILL_TRYING_EVERY_S), with slack.
REPEAT_S = 15.0
#: What a sar-worker needs beyond its join deadline to start and to exit (a loaded machine).
START_S = 5.0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}


def _status(*args: str) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sarcomm.coordinator.cli", "status", *args],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    return proc.returncode, proc.stderr, time.monotonic() - started


@pytest.fixture
def workers(tmp_path: Path, real_processes: None) -> Iterator[list[tuple[subprocess.Popen[bytes], Path]]]:
    started: list[tuple[subprocess.Popen[bytes], Path]] = []
    yield started
    for proc, _ in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _worker(
    coord: str, workers: list[tuple[subprocess.Popen[bytes], Path]], log: Path, join_timeout: float = 120
) -> tuple[subprocess.Popen[bytes], Path]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sarcomm.worker.agent.cli", "--coord", coord, "--job", "addr",
             "--world-size", "1", "--join-timeout", f"{join_timeout:g}", "--", "true"],
            stdout=out, stderr=subprocess.STDOUT, env=_env(),
        )  # fmt: skip
    workers.append((proc, log))
    return proc, log


def _unresolvable() -> str:
    return f"no-such-coordinator.invalid:{free_port()}"


def test_status_names_a_closed_port_within_seconds() -> None:
    target = f"127.0.0.1:{free_port()}"
    code, err, took = _status("--coord", target)
    assert code == 2
    assert took < SAY_S, took
    assert f"Cannot use the coordinator address {target} (connection refused): nothing accepts" in err, err


def test_status_names_an_unresolvable_host_within_seconds() -> None:
    target = _unresolvable()
    code, err, took = _status("--coord", target)
    assert code == 2
    assert took < SAY_S, took
    assert (
        f"{target} (name not resolved): the host name 'no-such-coordinator.invalid' does not resolve" in err
    )


def test_status_pointed_at_the_http_port_says_it_is_not_grpc(coordinator: CoordinatorProcess) -> None:
    target = f"127.0.0.1:{coordinator.http_port}"
    code, err, took = _status("--coord", target)
    assert code == 2
    assert took < SAY_S, took
    assert f"{target} (not a gRPC server): {target} answers HTTP/1.1, not gRPC" in err, err
    assert "--listen" in err


def test_status_refuses_a_url_as_address() -> None:
    code, err, _ = _status("--coord", "http://127.0.0.1:9400")
    assert code == 2
    assert "has the scheme 'http', which gRPC does not dial" in err, err


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_status_watch_needs_a_positive_interval(value: str) -> None:
    code, err, _ = _status("--coord", "127.0.0.1:1", f"--watch={value}")
    assert code == 2
    assert re.search(r"--watch[ =].* must be a positive number of seconds", err), err


def test_sar_worker_says_a_closed_port_at_once_and_keeps_saying_it_at_a_bounded_rate(
    workers: list[tuple[subprocess.Popen[bytes], Path]], tmp_path: Path
) -> None:
    target = f"127.0.0.1:{free_port()}"
    proc, log = _worker(target, workers, tmp_path / "worker.log")
    pattern = f"Join: cannot reach the coordinator at {target} (connection refused): nothing accepts"

    def said() -> int:
        assert proc.poll() is None, log.read_text()
        return log.read_text().count(pattern)

    started = time.monotonic()
    wait_for(said, SAY_S, what=lambda: f"the first warning: {log.read_text()}")
    first = time.monotonic() - started
    wait_for(lambda: said() >= 2, REPEAT_S + 5, what=lambda: f"the second warning: {log.read_text()}")
    assert said() == 2, log.read_text()  # bounded: not once per probe (every second)
    assert "still trying" in log.read_text()
    print(f"first warning after {first:.1f} s")


def test_sar_worker_says_an_unresolvable_host_within_seconds(
    workers: list[tuple[subprocess.Popen[bytes], Path]], tmp_path: Path
) -> None:
    target = _unresolvable()
    proc, log = _worker(target, workers, tmp_path / "worker.log")
    wait_for(
        lambda: f"{target} (name not resolved): the host name" in log.read_text(),
        SAY_S,
        what=lambda: f"the warning: {log.read_text()}",
    )
    assert proc.poll() is None  # a name may yet resolve: the join keeps waiting


def test_sar_worker_pointed_at_the_http_port_fails_within_seconds_saying_it_is_not_grpc(
    coordinator: CoordinatorProcess, workers: list[tuple[subprocess.Popen[bytes], Path]], tmp_path: Path
) -> None:
    target = f"127.0.0.1:{coordinator.http_port}"
    proc, log = _worker(target, workers, tmp_path / "worker.log")
    proc.wait(SAY_S + 5)
    text = log.read_text()
    assert proc.returncode != 0, text
    assert f"{target} (not a gRPC server): {target} answers HTTP/1.1, not gRPC" in text, text


@pytest.mark.parametrize(
    ("where", "problem"),
    [
        ("closed port", "connection refused: nothing accepts connections on"),
        (
            "unresolvable name",
            "name not resolved: the host name 'no-such-coordinator.invalid' does not resolve",
        ),
    ],
)
def test_sar_worker_gives_up_at_its_join_timeout_when_the_coordinator_cannot_be_reached(
    workers: list[tuple[subprocess.Popen[bytes], Path]], tmp_path: Path, where: str, problem: str
) -> None:
    # --join-timeout is the user's deadline, reaching the coordinator included (it was 30 s more).
    target = f"127.0.0.1:{free_port()}" if where == "closed port" else _unresolvable()
    started = time.monotonic()
    proc, log = _worker(target, workers, tmp_path / "worker.log", join_timeout=3)
    deadline = 3 + JOIN_ANSWER_SLACK_S
    try:
        proc.wait(deadline + START_S)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"sar-worker --join-timeout 3 still runs after {deadline + START_S:g} s: {log.read_text()}"
        )
    took = time.monotonic() - started
    text = log.read_text()
    assert proc.returncode == 1, text
    assert took >= 3, took
    *said, last = text.splitlines()
    # One line: what was wrong, found while it waited.
    assert last.startswith(
        f"sar-worker: error: job addr: The coordinator at {target} could not be reached within the "
        f"{deadline:g} s deadline of Join: check the address and that sar-coordinator is running there. "
        f"Found: {problem}"
    ), text
    # The warnings are as before: said at once, with what is left of the deadline.
    assert any(
        re.search(rf"Join: cannot reach the coordinator at {re.escape(target)} .*; still trying "
                  rf"\(\d+ s so far, \d+ s left\)$", line)
        for line in said
    ), text  # fmt: skip
    print(f"{where}: sar-worker --join-timeout 3 exited after {took:.1f} s")
