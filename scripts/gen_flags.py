"""Write ``docs/flags.md``, the flag reference, from the programs' own argparse parsers.

::

    python scripts/gen_flags.py          # rewrite docs/flags.md
    python scripts/gen_flags.py --check  # exit 1, naming the file, when it is not what this writes

Run it after adding or changing a flag; ``tests/test_flag_docs.py`` and ``scripts/check.sh`` fail
while the page and the parsers disagree. The parsers are built, never run: each program's
``build_parser`` (both declare their flags as ``sarcomm.common.flags.Option`` rows, whose help ends
the same way, and read no variable while building).

Each row's environment variables and default come from the help text each program prints for the
flag, which ends in ``(env NAME[ or NAME...][; default VALUE])`` or ``(default VALUE)``: the page
says what ``--help`` says, and a flag whose help names no variable has none.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sarcomm.coordinator import cli as coordinator_cli
from sarcomm.worker.agent import cli as worker_cli

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "flags.md"
COMMAND = "python scripts/gen_flags.py"

#: Each program and how to build its parser without running it.
PROGRAMS: tuple[tuple[str, Callable[[], argparse.ArgumentParser]], ...] = (
    ("sar-coordinator", coordinator_cli.build_parser),
    ("sar-worker", worker_cli.build_parser),
)

# The end of a flag's help: "(env A[ or B]; default V)", "(env A)" or "(default V)". A default
# holds no parenthesis, so "(default: ...) (env A)" ends in "(env A)" alone.
_TRAILER = re.compile(
    r"\s*\((?:env (?P<env>[A-Z][A-Z0-9_]*(?: or [A-Z][A-Z0-9_]*)*))?(?:; )?"
    r"(?:default (?P<default>[^()]*))?\)$"
)
#: Defaults the help prints that mean "none".
_NO_DEFAULT = ("", "None")


@dataclass(frozen=True)
class Flag:
    """One row of the reference."""

    invocation: str
    env: tuple[str, ...]
    default: str
    meaning: str


def _invocation(action: argparse.Action) -> str:
    """The flag as ``--help`` lists it: ``--listen LISTEN``, ``--watch [SECONDS]``, ``--json``."""
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    if action.metavar is not None:
        metavar = str(action.metavar)
    elif action.choices is not None:
        metavar = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        metavar = action.dest.upper()
    return f"{flags} [{metavar}]" if action.nargs == "?" else f"{flags} {metavar}"


def _flag(action: argparse.Action) -> Flag:
    help_text = (action.help or "").rstrip()
    trailer = _TRAILER.search(help_text)
    env: tuple[str, ...] = ()
    if trailer is not None and (trailer["env"] or trailer["default"] is not None):
        help_text = help_text[: trailer.start()]
        env = tuple(trailer["env"].split(" or ")) if trailer["env"] else ()
        default = trailer["default"] or ""  # not stripped: "[rank {rank}] " ends in a space
    elif action.default not in (None, False, argparse.SUPPRESS):
        default = str(action.default)
    else:
        default = ""
    if default in _NO_DEFAULT:
        default = ""
    return Flag(_invocation(action), env, default, " ".join(help_text.split()))


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The parser's flags, in order, without ``-h/--help``."""
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, help, parser)`` of each subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    """``text`` as a Markdown code span; quoted when spaces at its ends would be lost."""
    if text != text.strip():
        text = repr(text)
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}"


def _table(parser: argparse.ArgumentParser) -> list[str]:
    lines = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for action in _options(parser):
        flag = _flag(action)
        env = ", ".join(_code(name) for name in flag.env)
        default = _code(flag.default) if flag.default else ""
        lines.append(f"| {_code(flag.invocation)} | {env} | {_cell(default)} | {_cell(flag.meaning)} |")
    return lines


def _section(title: str, parser: argparse.ArgumentParser, summary: str = "") -> list[str]:
    lines = [f"## `{title}`", ""]
    for paragraph in (summary, parser.description or "", parser.epilog or ""):
        if paragraph:
            lines += [" ".join(paragraph.split()), ""]
    subcommands = list(_subcommands(parser))
    if subcommands:
        names = ", ".join(f"[`{name}`](#{_anchor(f'{title} {name}')})" for name, _, _ in subcommands)
        lines += [f"Subcommands: {names}.", ""]
    lines += [*_table(parser), ""]
    for name, help_text, sub in subcommands:
        lines += _section(f"{title} {name}", sub, help_text)
    return lines


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading ``` `title` ```."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def render() -> str:
    """The whole of ``docs/flags.md``."""
    lines = [
        "# Flags and environment variables",
        "",
        f"<!-- Generated by `{COMMAND}` from the programs' parsers: do not edit by hand. -->",
        "",
        f"Generated by `{COMMAND}` from the parsers of `sar-coordinator` and `sar-worker`; after adding "
        "or changing a flag, run it again (`tests/test_flag_docs.py` fails while this page and "
        "`--help` disagree).",
        "",
        "A flag that names an environment variable falls back to it when the flag is not given; the "
        "flag on the command line wins (`SARCOMM_HEARTBEAT_INTERVAL=0.5 sar-coordinator` is "
        "`sar-coordinator --heartbeat-interval 0.5`). Every command also takes `-h`/`--help`. What the "
        "settings do is told in the topic pages: [coordinator](coordinator.md), "
        "[worker agent](worker-agent.md), [high availability](high-availability.md), "
        "[security](security.md).",
        "",
    ]
    for name, build in PROGRAMS:
        lines += _section(name, build())
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/flags.md from the programs' parsers.")
    parser.add_argument("--check", action="store_true", help="only say whether docs/flags.md is current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is not what the parsers say: run `{COMMAND}` and commit it",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
