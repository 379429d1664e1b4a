"""The ranks' output through a real ``sar-worker``: whole tagged lines, stdout and stderr kept
apart, per-rank log files, and a failed rank's last lines under its failure line; a ``--log-dir``
or ``--output-tag`` that cannot work refused in one line before the agent joins."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.worker.agent.cli import EXIT_USAGE
from sarcomm.worker.agent.output import MAX_TAG_WIDTH, check_log_dir, check_output_tag, make_log_dir
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


def _refused(coord: CoordinatorProcess, *flags: str) -> str:
    """The one line ``sar-worker`` refuses ``flags`` with, checked before it joined: exit status 2,
    no traceback, no job at the coordinator."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    done = subprocess.run(
        [*SAR_WORKER, "--coord", coord.grpc_target, "--job", "refused",
         "--world-size", "1", *flags, "--", sys.executable, "-c", "print('ran')"],
        capture_output=True, text=True, timeout=AGENT_DEADLINE_S, env=env, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (EXIT_USAGE, ""), done.stderr
    assert coord.get_json("/v1/jobs") == {"jobs": []}
    (line,) = done.stderr.splitlines()
    return line


@pytest.mark.parametrize("where", ["a-file", "under-a-file", "/dev/null"])
def test_a_log_dir_that_is_no_folder_is_refused_in_one_line_before_joining(
    coordinator: CoordinatorProcess, tmp_path: Path, where: str
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    value, message = {
        "a-file": (afile, f"{afile} is not a folder"),
        "under-a-file": (afile / "logs", f"{afile} is not a folder, so {afile / 'logs'} cannot be created"),
        "/dev/null": (Path("/dev/null"), "/dev/null is not a folder"),
    }[where]
    line = _refused(coordinator, "--log-dir", str(value))
    assert line == (
        f"sar-worker: error: --log-dir {shorten(str(value))}: {message}; give a folder this user can "
        "write to, or create."
    )


@pytest.mark.parametrize(
    ("tag", "problem"),
    [
        ("{rank[0]}", "'{rank[0]}' indexes rank"),
        ("{rank.x}", "'{rank.x}' reads an attribute of rank"),
        ("{rank:x<99999999999}", f"'{{rank:x<99999999999}}': width 99999999999 is above {MAX_TAG_WIDTH}"),
    ],
    ids=["index", "attribute", "huge-width"],
)
def test_an_output_tag_that_would_not_format_is_refused_in_one_line_before_joining(
    coordinator: CoordinatorProcess, tag: str, problem: str
) -> None:
    line = _refused(coordinator, "--output-tag", tag)
    assert line == f"sar-worker: error: {TAG_RULE.format(tag=repr(tag))}: {problem}."


#: What an --output-tag error says before what is wrong with the tag.
TAG_RULE = (
    "--output-tag {tag} must be text with the placeholders {{rank}} and {{local_rank}} only, each with "
    "at most a number format such as {{rank:>3}} (write '{{{{' and '}}}}' for braces)"
)


@pytest.mark.parametrize(
    ("tag", "problem"),
    [
        ("{rank!r}", "'{rank!r}' converts rank (!r); a tag takes no conversion"),
        ("{rank!s:>3}", "'{rank!s:>3}' converts rank (!s); a tag takes no conversion"),
        ("{local_rank.real}", "'{local_rank.real}' reads an attribute of local_rank"),
        ("{host}", "'{host}' is not one of them"),
        ("{0}", "'{0}' is a position, not a name"),
        ("{}", "'{}' names no placeholder"),
        ("{rank", "a brace has no pair (expected '}' before end of string)"),
        ("rank}", "a brace has no pair (Single '}' encountered in format string)"),
        ("{rank:{local_rank}}", "'{rank:{local_rank}}' has a placeholder in its format"),
        ("{rank:s}", "'{rank:s}': 's' is not a format for a whole number (fill and align, sign, #, 0, "
         "width, ',' or '_', and a type of b, d, n, o, x or X)"),
        ("{rank:.3}", "'{rank:.3}': '.3' is not a format for a whole number (fill and align, sign, #, 0, "
         "width, ',' or '_', and a type of b, d, n, o, x or X)"),
        ("{rank:c}", "'{rank:c}': 'c' is not a format for a whole number (fill and align, sign, #, 0, "
         "width, ',' or '_', and a type of b, d, n, o, x or X)"),
        ("{rank:,b}", "'{rank:,b}': Cannot specify ',' with 'b'"),
        ("{rank:065}", f"'{{rank:065}}': width 65 is above {MAX_TAG_WIDTH}"),
        ("[{rank}]\n", "it holds a line break (each line a rank writes gets the tag once)"),
    ],
)  # fmt: skip
def test_check_output_tag_names_what_is_wrong_for_every_format_abuse(tag: str, problem: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        check_output_tag(tag)
    assert str(caught.value) == f"{TAG_RULE.format(tag=repr(tag))}: {problem}."


@pytest.mark.parametrize(
    ("tag", "line"),
    [("", "x"), ("[rank {rank}] ", "[rank 12] x"), ("{rank:>3}|{local_rank:02d} {{}} ", " 12|03 {} x"),
     (f"{{rank:*^{MAX_TAG_WIDTH}x}}", "*" * 31 + "c" + "*" * 32 + "x")],
)  # fmt: skip
def test_check_output_tag_keeps_every_tag_a_number_format_allows(tag: str, line: str) -> None:
    assert check_output_tag(tag) == tag
    assert tag.format(rank=12, local_rank=3) + "x" == line


def test_output_files_that_cannot_be_opened_fail_the_rank_before_it_runs_in_one_line(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    # The folder is fine, but where the job's files go is taken by a file.
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "blocked").write_text("not a folder\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    done = subprocess.run(
        [*SAR_WORKER, "--coord", coordinator.grpc_target, "--job", "blocked",
         "--world-size", "1", "--log-dir", str(logs), "--", sys.executable, "-c", "print('ran')"],
        capture_output=True, text=True, timeout=AGENT_DEADLINE_S, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 127, done.stderr
    assert "Traceback" not in done.stderr
    assert "ran" not in done.stdout
    last = done.stderr.splitlines()[-1]
    assert re.fullmatch(
        r"sar-worker: job blocked generation 1: rank 0 on host \S+ failed: could not open its output "
        rf"files: \[Errno 20\] Not a directory: '{re.escape(str(logs / 'blocked' / '1'))}'",
        last,
    ), last


def test_log_dir_checks_name_the_path_at_fault_and_create_nothing(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        check_log_dir(" ")
    assert str(caught.value) == (
        "no folder named; give a folder this user can write to, or create ('.' for the current one)."
    )
    deep = tmp_path / "a" / "b"
    assert check_log_dir(str(deep)) == deep
    assert not (tmp_path / "a").exists()  # checked, not made: the agent makes it before joining
    # What the checks cannot foresee is still one line, from the agent's mkdir before it joins.
    with pytest.raises(InvalidArgumentError) as caught:
        make_log_dir(Path("/proc/1/logs"))
    assert str(caught.value) == (
        "--log-dir '/proc/1/logs' must be a folder this user can create or write to: No such file or "
        "directory."
    )
    make_log_dir(deep)
    assert deep.is_dir()
