"""The coordinator's open-file limit: what it admits (said at start) and what it says when the table
is full (gRPC's listener then leaves new connections unaccepted, and says only so in its C core).

The fast tests take the budget and the watch with a fake table; the one integration test starts a
coordinator under ``prlimit --nofile=96`` and opens more connections than it has descriptors.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import shutil
import socket
import sys
from pathlib import Path

import pytest

from sarcomm.coordinator import fdlimit
from tests.conftest import CoordinatorProcess
from tests.helpers import free_ports, wait_for


def test_budget_reserves_what_is_open_at_start_and_a_margin() -> None:
    budget = fdlimit.FileBudget(limit=1024, at_start=30)
    assert budget.reserved == 30 + fdlimit.RESERVED_BEYOND_START
    assert budget.agent_connections == 1024 - 30 - fdlimit.RESERVED_BEYOND_START
    assert "open-file limit 1024: 930 agent connections" in budget.describe()
    assert fdlimit.FileBudget(limit=50, at_start=30).agent_connections == 0


def test_the_watch_says_once_per_episode_and_counts_each_full_table(caplog: pytest.LogCaptureFixture) -> None:
    budget = fdlimit.FileBudget(limit=200, at_start=20)  # admits 116 agent connections
    threshold = 200 - fdlimit.RESERVED_BEYOND_START  # 136 open: 116 agents
    # The lowest free descriptor at each look: below, past the budget, full x2, past, below, full.
    looks = [50, threshold + 1, fdlimit.FULL, fdlimit.FULL, threshold + 5, threshold, fdlimit.FULL]
    counted: list[int] = []
    watch = fdlimit.FileLimitWatch(budget, lambda: counted.append(1), probe=lambda: looks.pop(0))
    with caplog.at_level(logging.WARNING, logger=fdlimit.__name__):
        seen = [watch.check() for _ in range(7)]
    assert seen == [False, False, True, True, False, False, True]
    assert len(counted) == 2
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "ERROR", "WARNING", "ERROR"]
    assert "past what the open-file limit admits (RLIMIT_NOFILE 200: 116 agent connections)" in said[0][1]
    assert "open-file limit reached (RLIMIT_NOFILE 200)" in said[1][1]
    assert all("LimitNOFILE=" in message for _, message in said)


def test_next_descriptor_is_the_lowest_free_one_or_full() -> None:
    opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    try:
        lowest = min(opened)
        os.close(lowest)
        assert fdlimit.next_descriptor() == lowest
    finally:
        for fd in opened[1:]:
            os.close(fd)


def test_the_limit_is_raised_to_the_hard_limit() -> None:

    soft = fdlimit.raise_open_file_limit()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert soft == fdlimit.open_file_limit()
    assert soft == (hard if hard != resource.RLIM_INFINITY else fdlimit.UNLIMITED_STANDIN)


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_a_full_table_is_said_once_and_counted(tmp_path: Path, real_processes: None) -> None:
    grpc_port, http_port = free_ports(2)
    coord = CoordinatorProcess(
        grpc_port=grpc_port,
        http_port=http_port,
        state_path=None,
        args=["--log-level", "INFO"],
        log_path=tmp_path / "coordinator.log",
        command=["prlimit", "--nofile=96:96", sys.executable, "-m", "sarcomm.coordinator.cli"],
    )
    coord.start()
    try:
        started = re.search(r"open-file limit 96: (\d+) agent connections", coord.log())
        assert started is not None, coord.log()
        admitted = int(started.group(1))
        assert 0 < admitted < 96 - fdlimit.RESERVED_BEYOND_START
        # More connections than the table holds: the kernel completes each handshake; gRPC
        # accepts until the table is full and leaves the rest in the accept queue.
        flood = [socket.create_connection(("127.0.0.1", grpc_port), timeout=5) for _ in range(100)]
        try:
            wait_for(lambda: "open-file limit reached (RLIMIT_NOFILE 96)" in coord.log(), 15,
                     what="the coordinator to say its open-file limit is reached")  # fmt: skip
        finally:
            for sock in flood:
                sock.close()
        # Once the connections are gone there is room again, and /metrics answers with the count.
        wait_for(
            lambda: "sar_coordinator_open_file_limit_reached_total 1.0" in _metrics(coord),
            15,
            what="/metrics to count one episode",
        )
        assert "sar_coordinator_open_file_limit 96.0" in _metrics(coord)
        log = coord.log()
        assert log.count("open-file limit reached") == 1
        # Past the budget before full: said first, at WARNING.
        assert log.index("past what the open-file limit admits") < log.index("open-file limit reached")
    finally:
        coord.stop()


def _metrics(coord: CoordinatorProcess) -> str:
    try:
        return coord.get_text("/metrics")
    except OSError:
        return ""
