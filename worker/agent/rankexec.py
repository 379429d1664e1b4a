"""The launcher between ``sar-worker`` and one rank's command: the rank's process tree ends with
its agent, whatever the command is.

    python -m sarcomm.worker.agent.rankexec AGENT_PID -- COMMAND [ARGS...]

The agent starts this (in a new session, so it leads the rank's process group) instead of the
command itself. It

1. asks the kernel for SIGHUP when its parent dies (``PR_SET_PDEATHSIG``), then checks that its
   parent is still ``AGENT_PID``: an agent that died before the request took effect is seen too;
2. becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): the rank's descendants whose parent
   exits are re-parented here, not to init, so a daemonised grandchild stays in reach;
3. starts COMMAND (with ``PR_SET_PDEATHSIG`` SIGKILL of its own, should this launcher be killed
   alone) and waits for it, reaping re-parented orphans on the way;
4. when COMMAND ends, ends what it left behind (SIGTERM, SIGKILL after ``LEFTOVER_GRACE_S``) and
   exits with COMMAND's status (dying by the same signal when it was killed by one);
5. when the agent dies, ends the whole tree the same way (SIGTERM, SIGKILL after the grace) and
   then its process group;
6. on :data:`END_TREE_SIGNAL` (the agent's "kill the rank", sent once its stop grace is over, or
   on a second Ctrl-C), ends the whole tree at once (SIGKILL) and exits as killed by SIGKILL.

Why a launcher that stays, rather than one that sets the signal and execs COMMAND: the parent-death
signal reaches only the direct child, and ``sh -c 'sleep 300 & sleep 300'`` leaves a grandchild
that no signal to the shell reaches; a process group alone is left by anything that calls
``setsid``. A parent that outlives COMMAND's own processes and sees its re-parented orphans can end
all of them. Why Python here is safe: this is a fresh interpreter started by exec, with no gRPC
threads, so its ``preexec_fn`` (one ``prctl``) runs in a single-threaded fork.

SIGINT and SIGTERM are ignored by the launcher itself: the agent signals the rank's whole process
group (COMMAND gets them directly), and the launcher must outlive COMMAND to report its status.
Signal the group (``kill -TERM -PGID``), not the launcher alone. To kill a rank, do not SIGKILL its
group either (the launcher would die before it could end what left the group): send the launcher
:data:`END_TREE_SIGNAL`, as the agent does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

__all__ = ["END_TREE_SIGNAL", "LEFTOVER_GRACE_S", "main"]

#: Seconds the processes a rank leaves behind get between SIGTERM and SIGKILL.
LEFTOVER_GRACE_S = 2.0
#: What the agent sends the launcher alone to have the rank's whole tree killed now. A real-time
#: signal, which nothing sends by accident: SIGUSR1 and SIGUSR2 are what Slurm's ``--signal`` and
#: ``scancel -s`` send ahead of a time limit (to every process of the step, this launcher
#: included), and SIGHUP is what a user may send a group to have it reload.
END_TREE_SIGNAL = signal.SIGRTMIN + 2

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: What the launcher exits with when COMMAND could not be started (the shell's "not found").
EXIT_NOT_STARTED = 127


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {value}) failed: {os.strerror(errno)}")


def _child_dies_with_us() -> None:
    # Runs in the forked child before exec: only if this launcher is killed alone (the agent
    # signals the whole group, and ends the tree itself when it dies).
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _descendants() -> list[int]:
    """Every process below this one (the kernel's parent links, read from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [os.getpid()]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap() -> None:
    """Collect every exited child (re-parented orphans included) without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _end_tree(grace: float) -> None:
    """SIGTERM every descendant, SIGKILL those left after ``grace`` seconds (at once, when the
    agent asked for the end of the tree); reaps them."""
    deadline = time.monotonic() + grace
    signum = signal.SIGTERM
    while True:
        _reap()
        left = _descendants()
        if not left:
            return
        if _STATE.hurry or time.monotonic() >= deadline:
            signum = signal.SIGKILL
        for pid in left:
            try:
                os.kill(pid, signum)
                os.kill(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
            except (ProcessLookupError, PermissionError):
                pass
        # A short poll for the processes to go: each round reaps, looks again and escalates.
        time.sleep(0.05)


def _exit_like(status: int) -> None:
    """Exit as COMMAND did: its code, or death by its signal (without a core of our own)."""
    if os.WIFSIGNALED(status):
        _die_by(os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _die_by(signum: int) -> None:
    """End this process by ``signum`` (without a core of our own)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal that does not kill (cannot happen for a WTERMSIG)


class _State:
    """What the signal handlers share with the rest of the launcher."""

    def __init__(self) -> None:
        #: The launcher waits for COMMAND: a handler may break that wait (by raising). Outside it
        #: (starting COMMAND, ending the tree), the handlers only take note.
        self.waiting = False
        #: The agent asked for the end of the tree (:data:`END_TREE_SIGNAL`): no grace is left.
        self.hurry = False


_STATE = _State()


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        sys.stderr.write("usage: python -m sarcomm.worker.agent.rankexec AGENT_PID -- COMMAND [ARGS...]\n")
        os._exit(2)
    agent_pid, command = int(args[0]), args[2:]

    def on_hangup(signum: int, frame: FrameType | None) -> None:
        if os.getppid() != agent_pid and _STATE.waiting:
            raise _AgentGone

    def on_end_tree(signum: int, frame: FrameType | None) -> None:
        _STATE.hurry = True
        if _STATE.waiting:
            raise _EndTree

    signal.signal(signal.SIGHUP, on_hangup)
    signal.signal(END_TREE_SIGNAL, on_end_tree)
    for signum in (signal.SIGINT, signal.SIGTERM):
        # A handler, not SIG_IGN: an ignored signal would stay ignored in COMMAND across exec.
        signal.signal(signum, lambda signum, frame: None)
    try:
        status = _run(agent_pid, command)
    except _AgentGone:
        # Its stderr is most likely a pipe to the dead agent: a failed write must not stop the end.
        with contextlib.suppress(OSError):
            sys.stderr.write(
                f"sar-worker: its agent (pid {agent_pid}) is gone; ending the rank's processes\n"
            )
            sys.stderr.flush()
        _end_tree(LEFTOVER_GRACE_S)
        if os.getpgrp() == os.getpid():  # we lead the rank's group (the agent starts a new session)
            os.killpg(os.getpgrp(), signal.SIGKILL)  # anything of the group that left our tree; and us
        return
    except _EndTree:
        _end_tree(0.0)
        _die_by(signal.SIGKILL)  # as the agent's SIGKILL to the rank would have ended it
    _end_tree(LEFTOVER_GRACE_S)
    _exit_like(status)


class _AgentGone(Exception):
    """Raised by the SIGHUP handler once the agent is gone: it breaks the wait."""


class _EndTree(Exception):
    """Raised by the :data:`END_TREE_SIGNAL` handler: it breaks the wait."""


def _run(agent_pid: int, command: list[str]) -> int:
    """Start COMMAND and wait for it; returns its wait status."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != agent_pid:  # the agent died before the request above took effect
        raise _AgentGone
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    try:
        child = subprocess.Popen(command, preexec_fn=_child_dies_with_us)
    except OSError as exc:
        sys.stderr.write(f"sar-worker: could not start {command[0]!r}: {exc}\n")
        os._exit(EXIT_NOT_STARTED)
    _STATE.waiting = True
    try:
        # What came while COMMAND was being started (the handlers only took note then).
        if _STATE.hurry:
            raise _EndTree
        if os.getppid() != agent_pid:
            raise _AgentGone
        while True:
            # Python retries the wait after a signal's handler ran, unless the handler raised.
            pid, status = os.waitpid(-1, 0)
            if pid == child.pid:
                return status
    finally:
        _STATE.waiting = False


if __name__ == "__main__":
    main()
