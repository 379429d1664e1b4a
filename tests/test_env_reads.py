"""Every environment variable is read in one place, and named in one: the rules that
:mod:`sarcomm.worker.launch_env` and :mod:`sarcomm.common.constants` state, checked over the
package's source (``common/``, ``coordinator/``, ``worker/``) so that they hold without a reader's
care.

1. Only the modules in :data:`READERS_ALLOWED` read the environment: ``os.environ``,
   ``os.getenv``, and ``.get(...)``, ``[...]`` or ``in`` on a mapping called ``environ`` or
   ``env`` (writes, ``env[name] = value``, are not reads). Each entry says why it may.
2. A variable's name (every ``*_VARIABLE`` of :mod:`sarcomm.common.constants`, and the backends'
   interface variables) is spelt only where it is defined: anywhere else a string equal to it is
   an error, except the few in :data:`LITERALS_ALLOWED`, which are not the variable.

Pure source scans (``ast``): no process, no import of the scanned modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sarcomm.common import constants

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("common", "coordinator", "worker")

#: Module (path from the repository root; a folder ending in "/" covers what is inside) -> why it
#: may read the environment.
READERS_ALLOWED: dict[str, str] = {
    "worker/launch_env/": (
        "the one reader of the rank side: the launchers' variables and every SAR_*/SARCOMM_* setting "
        "a rank reads, and process_environ(), the library's only access to os.environ"
    ),
    "worker/autometrics/entry.py": (
        "runs inside every `import torch` of the environment (torch's entry point): it reads the few "
        "variables that tell a rank sarcomm started before importing anything, since launch_env "
        "imports gRPC (0.4 s) and a process that is not a rank must pay nothing"
    ),
    "common/flags.py": (
        "the one flag-and-variable mechanism of both programs: every flag also reads SARCOMM_<FLAG> "
        "(DESIGN.md), from the mapping the program's main passes in"
    ),
    "coordinator/cli.py": "its main passes os.environ to the flag mechanism (common/flags.py)",
    "worker/agent/cli.py": (
        "its main passes os.environ to the flag mechanism (common/flags.py); Slurm's variables, "
        "read through launch_env.slurm_task, decide whether a flag's fallback is asked for"
    ),
    "coordinator/systemd.py": (
        "NOTIFY_SOCKET is systemd's, not a sarcomm setting: the service manager sets it for this one "
        "process and sd_notify(3) reads it where the notice is sent; the coordinator may not import "
        "the worker side's launch_env, and no other coordinator module needs a variable"
    ),
    "worker/torchrun/": (
        "torchrun's agent process: the plugin reads its SARCOMM_* token and TLS variables as "
        "sar-worker does, and writes what the workers torch starts from that environment read"
    ),
    "worker/agent/supervisor.py": (
        "copies the agent's whole environment (os.environ) as the base every rank inherits; it reads "
        "no variable"
    ),
    "worker/agent/rank_process.py": (
        "looks COMMAND up on the PATH of the environment the rank is given (the mapping passed in), "
        "which is not a sarcomm setting"
    ),
    "worker/agent/config.py": (
        "builds the environment a rank is given, and keeps the OMP_NUM_THREADS the user set there"
    ),
}

#: (module, string) -> why the string, which equals a variable's name, is not that variable.
LITERALS_ALLOWED: dict[tuple[str, str], str] = {
    ("coordinator/status.py", constants.RANK_VARIABLE): "the RANK column heading of `sar-coordinator status`",
}

#: Where variables are named (the launchers' own names, OMPI_* etc., are in launch_env/launchers.py).
DEFINING_MODULES = ("common/constants.py",)

_ENV_NAMES = frozenset({"environ", "env"})
_OS_READERS = frozenset({"environ", "environb", "getenv", "getenvb"})


def _names_env(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.lstrip("_") in _ENV_NAMES


def env_reads(source: str) -> list[str]:
    """Where ``source`` reads the environment, as ``line: what`` strings, in order."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and node.attr in _OS_READERS
        ):
            found.append((node.lineno, f"os.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [(node.lineno, f"from os import {a.name}") for a in node.names if a.name in _OS_READERS]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and _names_env(node.func.value)
        ):
            found.append((node.lineno, f"{ast.unparse(node.func.value)}.get(...)"))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _names_env(node.value):
            found.append((node.lineno, f"{ast.unparse(node.value)}[...]"))
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.In, ast.NotIn)) and _names_env(right)
            for op, right in zip(node.ops, node.comparators, strict=True)
        ):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {what}" for line, what in sorted(found)]


def _modules() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT)) for folder in PACKAGE_FOLDERS for path in (ROOT / folder).rglob("*.py")
    )


def _allowed(module: str) -> bool:
    return any(module == key or (key.endswith("/") and module.startswith(key)) for key in READERS_ALLOWED)


def test_env_reads_finds_reads_and_not_writes() -> None:
    source = (
        "import os\n"
        "from os import getenv\n"
        "a = os.environ\n"
        "b = environ.get('X')\n"
        "c = self._env['X']\n"
        "d = 'X' in env\n"
        "env['X'] = '1'\n"
        "environ.update({'X': '1'})\n"
        "e = base.get('X')\n"
    )
    assert env_reads(source) == [
        "2: from os import getenv",
        "3: os.environ",
        "4: environ.get(...)",
        "5: self._env[...]",
        "6: 'X' in env",
    ]


def test_only_the_allowed_modules_read_the_environment() -> None:
    modules = _modules()
    assert "worker/launch_env/settings.py" in modules
    offenders = {
        module: reads
        for module in modules
        if not _allowed(module) and (reads := env_reads((ROOT / module).read_text()))
    }
    assert offenders == {}, (
        "read the environment through sarcomm.worker.launch_env (pass the mapping from "
        "process_environ() down from the library's entry point), or add the module to READERS_ALLOWED "
        f"with the reason: {offenders}"
    )


@pytest.mark.parametrize("entry", sorted(READERS_ALLOWED))
def test_every_allowed_reader_still_reads(entry: str) -> None:
    # An entry whose module stopped reading is taken off the list, so that the list stays the truth.
    modules = [m for m in _modules() if m == entry or (entry.endswith("/") and m.startswith(entry))]
    assert modules, f"{entry} is no module of the package"
    assert any(env_reads((ROOT / m).read_text()) for m in modules), f"{entry} reads no variable any more"


def _variable_names() -> set[str]:
    names = {value for key, value in vars(constants).items() if key.endswith("_VARIABLE")}
    return names | set(constants.INTERFACE_VARIABLES)


def test_every_variable_is_spelt_only_where_it_is_defined() -> None:
    names = _variable_names()
    assert {"RANK", "MASTER_PORT", "SAR_JOB", "SAR_COLLECTIVE_TIMEOUT", "SARCOMM_TLS_CA"} <= names
    spelt: dict[str, list[str]] = {}
    for module in _modules():
        if module in DEFINING_MODULES:
            continue
        for node in ast.walk(ast.parse((ROOT / module).read_text())):
            if (
                isinstance(node, ast.Constant)
                and node.value in names
                and (module, node.value) not in LITERALS_ALLOWED
            ):
                spelt.setdefault(module, []).append(f"{node.lineno}: {node.value!r}")
    assert spelt == {}, f"use the *_VARIABLE names of sarcomm.common.constants: {spelt}"
