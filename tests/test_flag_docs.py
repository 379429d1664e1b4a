"""``docs/flags.md`` is what ``scripts/gen_flags.py`` writes from the parsers, and it lists every
flag each program's ``--help`` lists, so the reference cannot drift from the programs.

In-process: the parsers are built and ``--help`` is asked of each ``main``; nothing is started.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from sarcomm.coordinator import cli as coordinator_cli
from sarcomm.worker.agent import cli as worker_cli

ROOT = Path(__file__).resolve().parent.parent
FLAGS_MD = ROOT / "docs" / "flags.md"

# An option line of argparse's help: two spaces, then "-h, --help" or "--flag ...".
_HELP_OPTION = re.compile(r"^  (?:-\w, )?(--[a-z0-9][a-z0-9-]*)", re.MULTILINE)
# A row of the reference: "| `--flag ...` | ...".
_DOC_ROW = re.compile(r"^\| `(--[a-z0-9][a-z0-9-]*)", re.MULTILINE)


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_flags", ROOT / "scripts" / "gen_flags.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _coordinator_help(argv: list[str]) -> int:
    return coordinator_cli.main([*argv, "--help"], env={})


def _worker_help(argv: list[str]) -> int:
    return worker_cli.main([*argv, "--help"])


# (section title in docs/flags.md, main, arguments before --help)
COMMANDS: list[tuple[str, Callable[[list[str]], int], list[str]]] = [
    ("sar-coordinator", _coordinator_help, []),
    ("sar-coordinator status", _coordinator_help, ["status"]),
    ("sar-worker", _worker_help, []),
    ("sar-worker bench", _worker_help, ["bench"]),
]


def _section(title: str) -> str:
    """The part of docs/flags.md under ``## `title` `` up to the next heading."""
    text = FLAGS_MD.read_text(encoding="utf-8")
    start = text.find(f"\n## `{title}`\n")
    assert start >= 0, f"docs/flags.md has no section for {title}: run `python scripts/gen_flags.py`"
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_flags_md_is_what_the_script_writes_from_the_parsers() -> None:
    expected = _load_script().render()
    assert FLAGS_MD.read_text(encoding="utf-8") == expected, (
        "docs/flags.md is stale: run `python scripts/gen_flags.py` and commit it"
    )


@pytest.mark.parametrize(("title", "main", "argv"), COMMANDS, ids=[title for title, _, _ in COMMANDS])
def test_every_flag_of_help_has_a_row_and_every_row_is_a_flag_of_help(
    title: str, main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 0
    in_help = set(_HELP_OPTION.findall(capsys.readouterr().out)) - {"--help"}
    in_doc = set(_DOC_ROW.findall(_section(title)))
    assert in_help, f"no flags found in `{title} --help`"
    assert in_help - in_doc == set(), f"flags of `{title} --help` missing from docs/flags.md"
    assert in_doc - in_help == set(), f"rows of docs/flags.md that `{title} --help` does not list"


def _row(title: str, flag: str) -> str:
    rows = [row for row in _section(title).splitlines() if row.startswith(f"| `{flag} ")]
    assert len(rows) == 1, f"{flag} has {len(rows)} rows in the {title} section"
    return rows[0]


def test_a_row_carries_the_variables_and_the_default_that_help_names() -> None:
    assert _row("sar-coordinator", "--heartbeat-interval") == (
        "| `--heartbeat-interval HEARTBEAT_INTERVAL` | `SARCOMM_HEARTBEAT_INTERVAL` | `1.0` | seconds "
        "between member reports |"
    )
    assert _row("sar-worker", "--socket-name") == (
        "| `--socket-name IFACE` | `SARCOMM_SOCKET_NAME`, `SAR_SOCKET_NAME` |  | network interface the ranks "
        "use (default: the coordinator chooses) |"
    )
    # A bench flag reads no variable; its default is the one its help names.
    assert _row("sar-worker bench", "--sizes").startswith("| `--sizes SPEC` |  | `1K:64M` |")
