"""Real ``torchrun`` nodes on loopback for the sarcomm rendezvous tests: each node is one
``python -m torch.distributed.run`` (an agent) with its workers (``tests/scripts/torchrun_train.py``),
killed, stopped or waited for as a whole; the workers' step records read back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.helpers import wait_for

TRAIN = Path(__file__).resolve().parent / "scripts" / "torchrun_train.py"
#: How long a test waits for torch-importing processes on a loaded 2-core machine, in seconds.
SLOW_S = 240.0


@dataclass
class Node:
    """One torchrun agent and its workers, started in a session of its own."""

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Node:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        return self

    def processes(self) -> list[psutil.Process]:
        """The agent and everything it started (torch starts its workers in sessions of their own)."""
        assert self.proc is not None
        try:
            agent = psutil.Process(self.proc.pid)
            return [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_all(self, sig: int) -> float:
        """Send ``sig`` to the agent and its workers at once; returns the monotonic time it was sent."""
        processes = self.processes()
        sent = time.monotonic()
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)
        return sent

    def wait(self, timeout: float = SLOW_S) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {self.name} still runs after {timeout:g} s: {self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        """Kill what is left of the node (test teardown)."""
        for process in self.processes():
            try:
                process.send_signal(signal.SIGCONT)
                process.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)


def torchrun_args(
    coord: str,
    job: str,
    out: Path,
    *,
    nnodes: str,
    nproc: int = 2,
    max_restarts: int = 0,
    conf: str = "",
    script_args: Sequence[str] = (),
) -> list[str]:
    """The command line of a node: torchrun's flags for the sarcomm backend, then the script."""
    return [
        "--rdzv-backend=sarcomm",
        f"--rdzv-endpoint={coord}",
        f"--rdzv-id={job}",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        *([f"--rdzv-conf={conf}"] if conf else []),
        str(TRAIN),
        str(out),
        *script_args,
    ]


def records(out: Path) -> list[dict[str, Any]]:
    """Every step record the workers wrote under ``out`` (a line being written is skipped)."""
    result = []
    for path in out.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                result.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return result


def wait_for_training(
    out: Path, generation: int, ranks: int, steps: int = 2, timeout: float = SLOW_S
) -> float:
    """Block until every one of ``ranks`` ranks of ``generation`` made ``steps`` steps; returns the
    Unix time of that generation's first step."""

    def trained() -> float | None:
        mine = [r for r in records(out) if r["generation"] == generation and "ok" in r]
        counts: dict[int, int] = {}
        for r in mine:
            counts[r["rank"]] = counts.get(r["rank"], 0) + 1
        if len(counts) == ranks and min(counts.values()) >= steps:
            return float(min(r["time"] for r in mine))
        return None

    return wait_for(trained, timeout, what=f"{ranks} ranks of generation {generation} to train {steps} steps")
