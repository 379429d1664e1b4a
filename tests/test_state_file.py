"""One coordinator per state file and per port, state files 0600, and nobody else's file touched:
real ``sar-coordinator`` processes, each refusal one line naming the path (or flag), the cause and
what to do, with no traceback and a non-zero exit."""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CoordinatorProcess
from tests.helpers import free_port

pytestmark = pytest.mark.integration

REFUSAL_DEADLINE_S = 30.0


def coordinator(state: Path, tmp_path: Path, grpc_port: int = 0, http_port: int = 0) -> CoordinatorProcess:
    return CoordinatorProcess(
        grpc_port=grpc_port or free_port(), http_port=http_port or free_port(), state_path=state, args=[],
        log_path=tmp_path / f"coordinator-{free_port()}.log",
    )  # fmt: skip


def refused(*args: str) -> str:
    """Run ``sar-coordinator ARGS``; it must exit non-zero at once with one line on stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "sarcomm.coordinator.cli", *args],
        capture_output=True, text=True, timeout=REFUSAL_DEADLINE_S, check=False,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("sar-coordinator: "), done.stderr
    return lines[0]


def ports(state: Path) -> list[str]:
    return [
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--http",
        f"127.0.0.1:{free_port()}",
        "--state",
        str(state),
    ]


@pytest.fixture
def running(tmp_path: Path, real_processes: None) -> Iterator[CoordinatorProcess]:
    coord = coordinator(tmp_path / "state.sqlite", tmp_path)
    coord.start()
    yield coord
    coord.stop()


def test_a_second_coordinator_on_the_same_state_exits_naming_the_file_and_the_holder(
    running: CoordinatorProcess,
) -> None:
    assert running.proc is not None
    assert running.state_path is not None
    line = refused(*ports(running.state_path))
    assert line == (
        f"sar-coordinator: --state {running.state_path}: another sar-coordinator (pid {running.proc.pid}) "
        "is using this state file; stop it first, or give this one another --state"
    )
    # The first one serves on, undisturbed.
    assert running.get_text("/healthz")


def test_a_second_coordinator_on_a_port_in_use_exits_with_one_line(
    running: CoordinatorProcess, tmp_path: Path
) -> None:
    grpc_taken = f"127.0.0.1:{running.grpc_port}"
    line = refused(
        "--listen", grpc_taken, "--http", f"127.0.0.1:{free_port()}", "--state", str(tmp_path / "b.sqlite")
    )
    assert line == (
        f"sar-coordinator: --listen {grpc_taken}: cannot listen there (address already in use); another "
        "process (another sar-coordinator?) holds the port: stop it or choose another --listen"
    )
    http_taken = f"127.0.0.1:{running.http_port}"
    line = refused(
        "--listen", f"127.0.0.1:{free_port()}", "--http", http_taken, "--state", str(tmp_path / "c.sqlite")
    )
    assert line.startswith(
        f"sar-coordinator: --http {http_taken}: cannot listen there (address already in use)"
    )


def test_state_files_are_created_0600(running: CoordinatorProcess) -> None:
    assert running.state_path is not None
    for path in running.state_path.parent.glob(f"{running.state_path.name}*"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def _foreign(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (name TEXT)")
        db.execute("INSERT INTO users VALUES ('ada')")


def _other_jobs(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE jobs (id INTEGER, owner TEXT)")


def _text(path: Path) -> None:
    path.write_text("not a database at all\n")


def _truncated(path: Path) -> None:
    _foreign(path)
    path.write_bytes(path.read_bytes()[:50])


def _damaged(path: Path) -> None:
    _foreign(path)
    data = bytearray(path.read_bytes())
    data[100:3000] = b"\xff" * 2900
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("make", "cause"),
    [
        (
            _foreign,
            "is another program's SQLite database (tables: users; application_id 0), not a sarcomm state",
        ),
        (
            _other_jobs,
            "is another program's SQLite database (tables: jobs; application_id 0), not a sarcomm state",
        ),
        (_text, "is not a SQLite database (it starts with b'not a database a'), so not a sarcomm state"),
        (_truncated, "is truncated (50 bytes, less than a SQLite header)"),
        (_damaged, "is damaged ("),
    ],
)
def test_a_file_that_is_not_a_sarcomm_state_is_refused_untouched(
    tmp_path: Path, make: object, cause: str
) -> None:
    path = tmp_path / "state.sqlite"
    assert callable(make)
    make(path)
    os.chmod(path, 0o644)
    before = (path.read_bytes(), path.stat().st_mtime_ns, stat.S_IMODE(path.stat().st_mode))
    line = refused(*ports(path))
    assert line.startswith(f"sar-coordinator: --state {path}: {cause}"), line
    assert (path.read_bytes(), path.stat().st_mtime_ns, stat.S_IMODE(path.stat().st_mode)) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.sqlite"]  # no -wal, -shm, lock


def test_a_directory_as_state_is_refused(tmp_path: Path) -> None:
    line = refused(*ports(tmp_path))
    assert line == (
        f"sar-coordinator: --state {tmp_path}: is a directory, not a file; give a file in it, e.g. "
        f"--state {tmp_path / 'state.sqlite'}"
    )


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root to mount a tmpfs")
def test_a_read_only_state_is_refused_with_the_cause(tmp_path: Path) -> None:
    mount = tmp_path / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True, timeout=30)
    try:
        state = mount / "state.sqlite"
        coord = coordinator(state, tmp_path)
        coord.start()
        coord.stop()
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, timeout=30)
        line = refused(*ports(state))
        assert line == (
            f"sar-coordinator: --state {state}: cannot be opened for reading and writing (Read-only file "
            "system); give a path in a writable folder, or fix the file's permissions"
        )
    finally:
        subprocess.run(["umount", str(mount)], check=False, timeout=30)


def test_a_state_of_an_earlier_version_is_taken_and_made_0600(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    with sqlite3.connect(path) as db:  # what sar-coordinator wrote before it set an application_id
        db.execute(
            "CREATE TABLE jobs (name TEXT NOT NULL, generation INTEGER NOT NULL, state TEXT NOT NULL, "
            "record TEXT NOT NULL, PRIMARY KEY (name, generation))"
        )
    os.chmod(path, 0o644)
    coord = coordinator(path, tmp_path)
    coord.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        coord.stop()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA application_id").fetchone()[0] == 0x53415243
