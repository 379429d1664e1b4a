"""The ranks' output through a real ``sar-worker``: whole tagged lines, stdout and stderr kept
apart, per-rank log files, and a failed rank's last lines under its failure line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import SAR_WORKER

RANK_SCRIPT = str(Path(__file__).parent / "scripts" / "output_rank.py")
AGENT_DEADLINE_S = 120.0
LINES, LENGTH = 200, 70_000  # long lines: a pipe carries at most 64 KiB at once


def run_agent(
    coord: CoordinatorProcess, job: str, *flags: str, args: tuple[int, int, int] = (LINES, LENGTH, 0)
) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    return subprocess.run(
        [
            *SAR_WORKER, "--coord", coord.grpc_target, "--job", job,
            "--world-size", "2", "--nproc-per-node", "2", "--heartbeat-interval", "0.25", *flags,
            "--", sys.executable, RANK_SCRIPT, *(str(a) for a in args),
        ],
        capture_output=True, timeout=AGENT_DEADLINE_S, env=env, check=False,
    )  # fmt: skip


def test_two_ranks_writing_long_lines_at_once_never_share_a_line(start_coordinator: StartCoordinator) -> None:
    coord = start_coordinator("--heartbeat-interval", "0.5")
    done = run_agent(coord, "lines")
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    counts = {0: 0, 1: 0}
    for line in done.stdout.split(b"\n")[:-1]:
        match = re.fullmatch(rb"\[rank ([01])\] ([ab]+)", line)
        assert match is not None, line[:120]
        rank = int(match[1])
        assert match[2] == (b"a" if rank == 0 else b"b") * LENGTH, f"rank {rank}'s line was mixed or cut"
        counts[rank] += 1
    assert counts == {0: LINES, 1: LINES}
    # stderr: each rank's own lines, tagged, in its order; never on stdout.
    err = done.stderr.decode()
    for rank in (0, 1):
        mine = re.findall(rf"(?m)^\[rank {rank}\] err {rank} (\d+)$", err)
        assert [int(i) for i in mine] == list(range(LINES))
    assert b"err " not in done.stdout


def test_log_dir_files_hold_exactly_each_ranks_output_and_tee_files_keeps_the_console_clear(
    start_coordinator: StartCoordinator, tmp_path: Path
) -> None:
    coord = start_coordinator("--heartbeat-interval", "0.5")
    logs = tmp_path / "logs"
    done = run_agent(coord, "files", "--log-dir", str(logs), "--tee", "files", args=(20, 1000, 0))
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    assert done.stdout == b""
    assert b"err " not in done.stderr
    for rank, letter in ((0, b"a"), (1, b"b")):
        folder = logs / "files" / "1"
        assert (folder / f"rank-{rank}.stdout").read_bytes() == (letter * 1000 + b"\n") * 20
        expected = "".join(f"err {rank} {i}\n" for i in range(20)) + f"last words {rank}\n"
        assert (folder / f"rank-{rank}.stderr").read_text() == expected


def test_an_empty_tag_leaves_lines_as_the_rank_wrote_them(start_coordinator: StartCoordinator) -> None:
    coord = start_coordinator("--heartbeat-interval", "0.5")
    done = run_agent(coord, "untagged", "--output-tag", "", args=(5, 10, 0))
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    assert sorted(done.stdout.decode().splitlines()) == ["a" * 10] * 5 + ["b" * 10] * 5


def test_a_failed_ranks_last_lines_follow_its_failure_line_and_status_names_its_log(
    start_coordinator: StartCoordinator, tmp_path: Path
) -> None:
    coord = start_coordinator("--heartbeat-interval", "0.5")
    logs = tmp_path / "logs"
    # Both ranks write 30 lines and exit 3: the first to exit is blamed, its tail shown.
    done = run_agent(coord, "tail", "--log-dir", str(logs), args=(30, 10, 3))
    assert done.returncode == 3
    err = done.stderr.decode()
    failure = re.search(r"rank (\d) on host \S+ exited with code 3\n", err)
    assert failure is not None, err
    rank = failure[1]
    stderr_log = logs / "tail" / "1" / f"rank-{rank}.stderr"
    tail = re.search(
        rf"last 20 line\(s\) of rank {rank}'s stderr; all of it in \S+rank-{rank}.stdout and "
        rf"{re.escape(str(stderr_log))}:\n((?:    \| .*\n){{20}})",
        err,
    )
    assert tail is not None, err
    shown = [line.removeprefix("    | ") for line in tail[1].splitlines()]
    # Its stderr's last 20 lines, where a traceback would be, in the order written.
    assert shown == [f"err {rank} {i}" for i in range(11, 30)] + [f"last words {rank}"]
    # The final line stays the one-line verdict, and the coordinator's reason points to the log.
    assert err.splitlines()[-1].startswith("sar-worker: job tail generation 1: rank ")
    jobs = coord.get_json("/v1/jobs")
    assert isinstance(jobs, dict)
    (job,) = [j for j in jobs["jobs"] if j["job"] == "tail"]
    reasons = [m["reason"] for m in job["members"] if str(m["rank"]) == rank]
    assert reasons == [f"exited with code 3; log: {reasons[0].split('; log: ')[1]}"]
    assert reasons[0].endswith(f":{stderr_log}")
