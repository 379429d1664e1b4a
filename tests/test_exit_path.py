"""The exit path of a rank: it never hangs, on every torch sarcomm admits (``torch>=2.2``).

On torch 2.2.1 a rank that finished training sometimes never exited: the exit hook's destroy of
the process group joined gloo's threads holding the GIL while a gloo thread waited for the GIL to
finish the last collective (``sarcomm.worker.library.teardown`` has the whole story). These tests run real
four-rank gloo jobs (processes started as a user's script is, so that the interpreter's exit hooks
run), check every collective's values, and bound every exit by a deadline. ``bash
scripts/test-torch-floor.sh`` runs them on torch 2.2.1 in its own venv; the main suite on the
current torch.

The rank script makes the race near certain rather than likely (see
``tests/scripts/exit_rank.py``): before the fix this test failed on torch 2.2.1 within its first
two jobs, each time it ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.integration

RANK_SCRIPT = Path(__file__).parent / "scripts" / "exit_rank.py"
REPO = Path(__file__).resolve().parents[1]
WORLD = 4
#: Jobs in a row: before the fix, on torch 2.2.1, even a natural exit (without the script's
#: forcing) hung in 7 of 16 jobs, so 10 would all pass by luck with a chance of about 0.3%. The
#: hang was seen on torch 2.2.x, where scripts/test-torch-floor.sh runs the 10; on the main
#: suite's newer torch 3 jobs guard the exit path at a third of the suite's time.
REPETITIONS = 10 if torch.__version__.startswith("2.2.") else 3
#: From the moment a rank wrote its result (its last line of Python) to its exit. A clean exit
#: takes well under a second; the hang lasted until killed.
EXIT_DEADLINE_S = 20.0
#: For the four ranks to start, import torch and train (two cores shared with other tests).
START_DEADLINE_S = 120.0


@dataclass
class Job:
    """A job's rank processes and where each writes its result."""

    procs: list[subprocess.Popen[str]]
    outs: list[Path]
    written_at: dict[int, float] = field(default_factory=dict)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            for stream in (proc.stdin, proc.stderr):
                if stream is not None:
                    stream.close()

    def stderr_of(self, rank: int) -> str:
        stream = self.procs[rank].stderr
        return stream.read()[-3000:] if stream is not None and self.procs[rank].poll() is not None else ""


def start_job(mode: str, world: int, tmp: Path, env: dict[str, str] | None = None) -> Job:
    port = free_port()
    rank_env = {
        **os.environ,
        "SAR_SOCKET_NAME": "lo",
        "SAR_COLLECTIVE_TIMEOUT": "60",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        **(env or {}),
    }
    outs = [tmp / f"rank{rank}.json" for rank in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), mode, str(rank), str(world), str(port), str(outs[rank])],
            env=rank_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    return Job(procs, outs)


def run_to_exit(job: Job, ranks: range, label: str) -> dict[int, float]:
    """Waits until each of ``ranks`` wrote its result and exited; returns rank -> seconds from its
    result to its exit. Fails when a rank does not write in time, exits before writing, or is
    still alive :data:`EXIT_DEADLINE_S` after writing."""
    start = time.monotonic()
    exit_s: dict[int, float] = {}

    def progressed() -> bool:
        now = time.monotonic()
        for rank in ranks:
            if rank in exit_s:
                continue
            if rank not in job.written_at and job.outs[rank].exists():
                job.written_at[rank] = now
            code = job.procs[rank].poll()
            if rank not in job.written_at:
                assert code is None, (
                    f"{label}: rank {rank} exited with {code} before its result:\n{job.stderr_of(rank)}"
                )
                assert now - start < START_DEADLINE_S, (
                    f"{label}: rank {rank} wrote no result in {START_DEADLINE_S} s"
                )
            elif code is not None:
                exit_s[rank] = now - job.written_at[rank]
            else:
                assert now - job.written_at[rank] < EXIT_DEADLINE_S, (
                    f"{label}: rank {rank} still running {EXIT_DEADLINE_S} s after its last line (exit hung)"
                )
        return len(exit_s) == len(ranks)

    wait_for(progressed, START_DEADLINE_S + EXIT_DEADLINE_S, what=f"{label}: every rank's exit")
    return exit_s


def test_four_rank_jobs_exit_every_time_with_correct_values(tmp_path: Path) -> None:
    slowest: list[float] = []
    for repetition in range(REPETITIONS):
        label = f"torch {torch.__version__}, job {repetition + 1} of {REPETITIONS}"
        folder = tmp_path / f"job{repetition}"
        folder.mkdir()
        job = start_job("train", WORLD, folder)
        try:
            exit_s = run_to_exit(job, range(WORLD), label)
            for rank, proc in enumerate(job.procs):
                assert proc.returncode == 0, (
                    f"{label}: rank {rank} exited with {proc.returncode}:\n{job.stderr_of(rank)}"
                )
                result = json.loads(job.outs[rank].read_text())
                assert result == {"rank": rank, "rounds": 5, "wrong": []}, f"{label}: {result}"
            slowest.append(max(exit_s.values()))
        finally:
            job.kill()
    print(f"torch {torch.__version__}: slowest exit per job (s): {[round(s, 2) for s in slowest]}")


def test_an_exit_while_a_collective_waits_for_a_silent_peer_ends_at_the_deadline_with_its_code(
    tmp_path: Path,
) -> None:
    # Rank 0 exits with code 3 while its all_reduce waits for rank 1, which is alive and silent:
    # ending the group waits for that collective (up to SAR_COLLECTIVE_TIMEOUT, 60 s here). At
    # SAR_EXIT_TIMEOUT (2 s) the exit hook shuts the group's connections; the exit then completes
    # normally, with the status the program gave.
    job = start_job("silent-peer", 2, tmp_path, {"SAR_EXIT_TIMEOUT": "2"})
    try:
        exit_s = run_to_exit(job, range(1), "silent peer")
        assert job.procs[0].returncode == 3, job.stderr_of(0)
        assert exit_s[0] >= 2.0, (
            f"the exit ended at {exit_s[0]:.2f} s, before the deadline: what did it wait for?"
        )
        stderr = job.stderr_of(0)
        assert "took longer than 2 s (SAR_EXIT_TIMEOUT); shut down their" in stderr, stderr
        assert job.procs[1].poll() is None, "the silent rank must still be running: it was never told"
    finally:
        job.kill()


DEADLINE_SCRIPT = """
import ctypes, logging, sys, time
logging.basicConfig(level=logging.INFO)
from sarcomm.worker.library.teardown import ExitDeadline

def hang():
    with ExitDeadline(0.5, frozenset(), "test"):
        {body}

import atexit
atexit.register(hang)
{main}
"""


@pytest.mark.parametrize(
    ("main", "code"),
    [("sys.exit(0)", 0), ("raise RuntimeError('training failed')", 1)],
    ids=["clean-exit", "uncaught-exception"],
)
def test_an_exit_hook_that_cannot_finish_ends_the_process_with_the_programs_code(
    main: str, code: int
) -> None:
    # The hook's body waits (GIL released) for something that never comes and has no connection
    # to shut down: after 0.5 s + the 5 s grace, the process ends with 0, or 1 after an uncaught
    # exception, as the interpreter would have.
    script = DEADLINE_SCRIPT.format(body="time.sleep(120)", main=main)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - start
    assert done.returncode == code, done.stderr
    assert "did not end within 5 s of their connections' shutdown; exiting with code" in done.stderr
    assert took < 30, f"took {took:.1f} s"


def test_an_exit_hook_that_holds_the_gil_is_ended_by_the_backstop() -> None:
    # The body never releases the GIL (a C call through PyDLL keeps it), so the deadline's thread
    # never runs; faulthandler's watchdog, which needs no GIL, prints the stacks and exits with 1.
    script = DEADLINE_SCRIPT.format(body="ctypes.PyDLL(None).sleep(120)", main="sys.exit(0)")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - start
    assert done.returncode == 1, done.stderr
    assert "Timeout (0:00:10.5" in done.stderr, done.stderr
    assert took < 40, f"took {took:.1f} s"
