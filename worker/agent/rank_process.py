"""What the agent asks the kernel about its ranks' processes, and how it starts them.

- :func:`process_state`: the one-letter state of a process as ``/proc/PID/stat`` reports it. It
  needs nothing from the process itself, so it tells a stopped (``T``) or dead (``Z``, gone) rank
  from one whose Python is busy (``R``, ``S``, ``D``: its own threads may not run, but it does).
  One small read per rank and interval.
- :func:`launch_command`: COMMAND wrapped in :mod:`sarcomm.worker.agent.rankexec`, which ends the rank's
  whole process tree when the agent dies.
- :func:`command_problem`: why COMMAND cannot be started, found before starting the launcher (the
  launcher would only exit 127).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence

__all__ = ["command_problem", "launch_command", "process_state"]


def process_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (``R``, ``S``, ``D``, ``T``, ``t``, ``Z`` ...), or None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and ')': split after the last.
    after = data.rsplit(b")", 1)[-1].split()
    return after[0].decode() if after else None


def launch_command(command: Sequence[str], agent_pid: int | None = None) -> list[str]:
    """The argv that runs ``command`` under the rank launcher, bound to the agent ``agent_pid``
    (default this process)."""
    pid = os.getpid() if agent_pid is None else agent_pid
    return [sys.executable, "-m", "sarcomm.worker.agent.rankexec", str(pid), "--", *command]


def command_problem(command: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """Why ``command`` cannot be executed with ``environ``'s ``PATH``, or None when it can."""
    program = command[0]
    if os.sep in program:
        if not os.path.isfile(program):
            return f"no such file: {program!r}"
        if not os.access(program, os.X_OK):
            return f"{program!r} is not executable (chmod +x it)"
        return None
    if shutil.which(program, path=environ.get("PATH", os.defpath)) is None:
        return f"{program!r} was not found on PATH ({environ.get('PATH', os.defpath)})"
    return None
