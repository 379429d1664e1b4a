"""Extra ports reserved with the master port, for SAR's sampling workers (``master_port()+k+1``).

Real coordinator, real ``sar-worker`` agents (or a process registering itself), real rank
processes; the ports are checked against the kernel: a port another job could take is one that a
plain ``bind`` (no ``SO_REUSEADDR``, what a reservation does) gets.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.ports import PortBlock, check_extra_ports, extra_ports
from tests.conftest import CoordinatorProcess
from tests.helpers import SAR_WORKER, port_taken, wait_for

RANK_SCRIPT = Path(__file__).parent / "scripts" / "extra_ports_rank.py"
EXTRA = 3


class Job:
    """One job: an agent (or a self-registering process) running extra_ports_rank.py."""

    def __init__(self, coord: CoordinatorProcess, name: str, tmp: Path, how: str) -> None:
        self.out, self.go = tmp / f"{name}.json", tmp / f"{name}.go"
        rank = [sys.executable, str(RANK_SCRIPT), str(self.out), str(self.go)]
        if how == "sar-worker":
            command = [
                *SAR_WORKER, "--coord", coord.grpc_target, "--job", name,
                "--world-size", "1", "--extra-ports", str(EXTRA), "--socket-name", "lo", "--", *rank,
            ]  # fmt: skip
        else:
            command = [*rank, how, coord.grpc_target, name, str(EXTRA)]
        self.log = tmp / f"{name}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def ports(self) -> dict[str, object]:
        found: dict[str, object] = wait_for(
            lambda: (
                json.loads(self.out.read_text()) if self.out.exists() and self.out.stat().st_size else None
            ),
            60,
            what=lambda: f"{self.out} (log: {self.log.read_text()[-2000:]})",
        )
        return found

    def finish(self) -> list[int]:
        self.go.touch()
        assert self.proc.wait(60) == 0, self.log.read_text()[-3000:]
        bound: list[int] = json.loads(Path(f"{self.out}.bound").read_text())
        return bound

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def jobs(coordinator: CoordinatorProcess, tmp_path: Path) -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


@pytest.mark.parametrize("how", ["sar-worker", "coord_ip_init", "init"])
def test_extra_ports_are_held_for_the_job_and_its_ranks_can_listen_on_them(
    coordinator: CoordinatorProcess, jobs: list[Job], tmp_path: Path, how: str
) -> None:
    a = Job(coordinator, "job-a", tmp_path, how)
    jobs.append(a)
    seen_a = a.ports()
    master_a = int(str(seen_a["master_port"]))
    assert seen_a["extra"] == [master_a + 1, master_a + 2, master_a + 3]
    # Held while job A runs, before any of its ranks listens there: no other reservation gets them.
    assert [port for port in extra_ports(master_a, EXTRA) if not port_taken(port)] == []

    # Job B on the same host, same coordinator, while A holds its ports.
    b = Job(coordinator, "job-b", tmp_path, how)
    jobs.append(b)
    seen_b = b.ports()
    ports_a = {master_a, *extra_ports(master_a, EXTRA)}
    ports_b = {int(str(seen_b["master_port"])), *extra_ports(int(str(seen_b["master_port"])), EXTRA)}
    assert ports_a.isdisjoint(ports_b), (ports_a, ports_b)
    # Neither the kernel's choice nor another block ever lands on A's held ports.
    blocks = [PortBlock.reserve(EXTRA) for _ in range(100)]
    try:
        others = {port for block in blocks for port in (block.store_port, *block.extra)}
        assert others.isdisjoint(ports_a - {master_a}), others & ports_a
    finally:
        for block in blocks:
            block.close()

    # Each job's rank listens on its own extra ports, while they are still held for it.
    assert a.finish() == sorted(ports_a - {master_a})
    assert b.finish() == sorted(ports_b - {int(str(seen_b["master_port"]))})


def test_extra_ports_count_is_checked_naming_the_field() -> None:
    assert check_extra_ports(0, "--extra-ports") == 0
    for bad in (-1, 65, 2.0, True, "3"):
        with pytest.raises(InvalidArgumentError, match=r"^--extra-ports .* must be an integer in 0\.\.64: "):
            check_extra_ports(bad, "--extra-ports")


def test_a_block_holds_consecutive_ports_that_a_plain_bind_cannot_take() -> None:
    block = PortBlock.reserve(4)
    try:
        assert block.extra == extra_ports(block.store_port, 4)
        assert all(port_taken(port) for port in (block.store_port, *block.extra))
        block.keep_if_master(block.store_port + 100)  # not the master: everything released
        assert block.extra == ()
    finally:
        block.close()
