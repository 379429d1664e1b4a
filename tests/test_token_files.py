"""Token files: one rule on both sides (non-empty, one line of printable ASCII), checked at start
with one line naming the file: real ``sar-coordinator``, ``sar-coordinator status`` and
``sar-worker`` processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

DEADLINE_S = 30.0
BAD = {
    "empty": (b"", "is empty: it must hold a non-empty token"),
    "blank": (b"  \n\n", "is empty: it must hold a non-empty token"),
    "two-lines": (b"abc\ndef\n", "must hold one line of printable ASCII without spaces"),
    "non-ascii": ("t\u00f6ken".encode(), "must hold one line of printable ASCII without spaces"),
    "inner-space": (b"abc def", "must hold one line of printable ASCII without spaces"),
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=DEADLINE_S, check=False
    )


@pytest.mark.integration  # each command as a process
@pytest.mark.parametrize("case", sorted(BAD))
def test_every_command_refuses_a_bad_token_file_naming_it(tmp_path: Path, case: str) -> None:
    content, rule = BAD[case]
    token = tmp_path / "token"
    token.write_bytes(content)
    commands = {
        "sar-coordinator": (
            "sarcomm.coordinator.cli", "--listen", f"127.0.0.1:{free_port()}", "--http",
            f"127.0.0.1:{free_port()}", "--token-file", str(token),
        ),
        "sar-coordinator status": (
            "sarcomm.coordinator.cli", "--token-file", str(token), "status",
            "--coord", f"127.0.0.1:{free_port()}",
        ),
        "sar-worker": (
            "sarcomm.worker.agent.cli", "--coord", f"127.0.0.1:{free_port()}", "--job", "j",
            "--world-size", "1", "--token-file", str(token), "--", "true",
        ),
    }  # fmt: skip
    for name, args in commands.items():
        done = run(*args)
        assert done.returncode == 2, (name, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, (name, done.stderr)
        assert f"--token-file '{token}' {rule}" in lines[0], (name, lines[0])
        assert "Traceback" not in done.stderr


def test_a_token_with_surrounding_whitespace_is_the_same_token_on_both_sides(tmp_path: Path) -> None:
    from sarcomm.common.tls import read_token_file

    token = tmp_path / "token"
    token.write_bytes(b"  s3cret-TOKEN_1\n")
    assert read_token_file(token) == "s3cret-TOKEN_1"
