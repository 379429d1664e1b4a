"""What the agent asks the kernel about its ranks' processes, and how it starts them.

- :func:`process_state`: the one-letter state of a process as ``/proc/PID/stat`` reports it. It
  needs nothing from the process itself, so it tells a stopped (``T``) or dead (``Z``, gone) rank
  from one whose Python is busy (``R``, ``S``, ``D``: its own threads may not run, but it does).
  One small read per rank and interval.
- :func:`launch_command`: COMMAND wrapped in :mod:`sarcomm.worker.agent.rankexec`, which ends the rank's
  whole process tree when the agent dies, and when the agent asks it to.
- :class:`RankProcess`: the launcher started with its stdout and stderr on pipes. Its
  :meth:`~RankProcess.wait` returns when the process exits, whoever still holds the pipes (a
  helper of the rank in a session of its own may hold them for ever), which asyncio's
  ``Process.wait`` does not (it waits for the pipes to close too, up to Python 3.11 at least).
- :func:`kill_ranks`: each launcher kills its rank's whole tree; :func:`wait_exits` waits,
  bounded, for the ranks' processes to exit.
- :func:`command_problem`: why COMMAND cannot be started, found before starting the launcher (the
  launcher would only exit 127).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Iterable, Mapping, Sequence

from sarcomm.worker.agent.rankexec import END_TREE_SIGNAL

__all__ = [
    "END_TREE_WAIT_S",
    "KILL_WAIT_S",
    "RankProcess",
    "command_problem",
    "kill_ranks",
    "launch_command",
    "process_state",
    "running",
    "wait_exits",
]

log = logging.getLogger(__name__)

#: Seconds the launchers get to end their ranks' trees once asked (they SIGKILL at once: a few
#: hundred milliseconds), before the agent SIGKILLs the ranks' process groups itself.
END_TREE_WAIT_S = 5.0
#: Seconds to wait for a rank to exit after that SIGKILL (only a process stuck in the kernel takes
#: longer).
KILL_WAIT_S = 5.0

#: How much of a rank's output a pipe reader buffers before it stops reading (asyncio's default):
#: a rank that writes faster than the console takes waits in ``write``, the agent's memory stays put.
PIPE_BUFFER_BYTES = 1 << 16


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


class _ExitWatch(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol for a process with pipes, which also resolves ``exited`` when the process
    exits (asyncio's own ``wait`` also waits for the pipes to reach their end)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=PIPE_BUFFER_BYTES, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class RankProcess:
    """One rank's launcher, started by :meth:`start` in a session (and process group) of its own,
    with its stdout and stderr on pipes (``stdout``, ``stderr``)."""

    def __init__(
        self, transport: asyncio.SubprocessTransport, protocol: _ExitWatch, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._transport = transport
        self._exited = protocol.exited
        self._process = asyncio.subprocess.Process(transport, protocol, loop)
        self.pid = self._process.pid
        self.stdout = self._process.stdout
        self.stderr = self._process.stderr

    @classmethod
    async def start(cls, argv: Sequence[str], env: Mapping[str, str]) -> RankProcess:
        """Start ``argv`` with ``env``.

        Raises:
            OSError: the program could not be started.
        """
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.subprocess_exec(
            lambda: _ExitWatch(loop),
            *argv,
            env=env,
            start_new_session=True,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(transport, protocol, loop)

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal), or None while the process runs."""
        return self._process.returncode

    async def wait(self) -> int:
        """Wait until the process exits (not for its pipes); return its :attr:`returncode`."""
        await asyncio.shield(self._exited)
        returncode = self._process.returncode
        assert returncode is not None  # set before asyncio tells the protocol
        return returncode

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the process group: the launcher and every process of the rank that
        stayed in it (a process that left it, with ``setsid``, is not reached)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def end_tree(self) -> None:
        """Ask the launcher to end the rank's whole process tree now (SIGKILL to every process
        below it, those that left the group included) and exit as if killed by SIGKILL."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, END_TREE_SIGNAL)
            os.kill(self.pid, signal.SIGCONT)  # a stopped launcher acts on it only once continued

    def close(self) -> None:
        """Close the pipes (after the exit: whoever else holds them, the agent reads no more)."""
        self._transport.close()


def running(processes: Mapping[int, RankProcess]) -> list[int]:
    """The ranks (keys of ``processes``) whose process has not exited."""
    return [rank for rank, process in processes.items() if process.returncode is None]


async def wait_exits(processes: Iterable[RankProcess], timeout: float) -> bool:
    """Wait until every process of ``processes`` exited, at most ``timeout`` seconds; whether all did."""
    waits = [asyncio.ensure_future(process.wait()) for process in processes]
    if not waits:
        return True
    _, pending = await asyncio.wait(waits, timeout=timeout)
    for task in pending:
        task.cancel()
    return not pending


async def kill_ranks(processes: Mapping[int, RankProcess], label: str) -> None:
    """Kill the ranks ``processes`` (by global rank) run: each launcher SIGKILLs its rank's whole
    tree (it knows the processes that left the group; a SIGKILL to the group would kill it first).
    The groups of launchers still running :data:`END_TREE_WAIT_S` later get SIGKILL."""
    for rank in running(processes):
        processes[rank].end_tree()
    if await wait_exits(processes.values(), END_TREE_WAIT_S):
        return
    log.warning(
        "%s: the launcher(s) of rank(s) %s did not end their process trees within %g s; sending "
        "SIGKILL to their process groups (processes that left a group may survive)",
        label, running(processes), END_TREE_WAIT_S,
    )  # fmt: skip
    for rank in running(processes):
        processes[rank].signal_group(signal.SIGKILL)
    if not await wait_exits(processes.values(), KILL_WAIT_S):
        log.error(
            "%s: rank(s) %s still running %g s after SIGKILL (stuck in the kernel?)",
            label, running(processes), KILL_WAIT_S,
        )  # fmt: skip
