"""Ending the process groups: without deadlock on every torch sarcomm admits, and within a
deadline at interpreter exit.

**The deadlock (torch 2.2 to 2.7).** When the last reference to a ``ProcessGroup``'s Python object
goes, pybind11 destroys the C++ group, and with it its backends, *holding the GIL*: until torch 2.8
the ``ProcessGroup`` binding has no destructor that releases it. ``ProcessGroupGloo``'s destructor
joins its worker threads. A worker thread that has just finished a collective still holds the work,
and with it the last reference to a tensor whose Python object is gone; freeing that tensor takes
the GIL (``c10::impl::PyObjectSlot::maybe_destroy_pyobj``). The thread waits for the GIL, the main
thread waits for the thread: the rank never exits. On torch 2.2.1 a plain four-rank job's exit
hung so in 7 of 16 runs (both stacks taken with gdb); ``tests/test_exit_path.py`` makes the race
near certain.

**The fix** (:func:`end_groups`): hold a Python reference to each backend of the groups
(``ProcessGroupGloo``, ``ProcessGroupNCCL``: their bindings *do* release the GIL in their
destructors, on every torch >= 2.2) while torch destroys the groups, then drop those references.
The backends' destructors, joins included, then run with the GIL released, and the worker thread
frees its tensor. On torch >= 2.8 the order changes nothing.

**The deadline** (:class:`ExitDeadline`). A backend's destructor also waits for the collectives it
has queued or running, and one that waits for a silent peer ends only at the group's timeout
(``SAR_COLLECTIVE_TIMEOUT``, 300 s by default). The exit hook therefore runs under a deadline
(``SAR_EXIT_TIMEOUT``, 30 s by default); when it passes, the groups' connections are shut down so
that what waits on them fails at once and the exit completes normally, with the exit status the
interpreter was going to return. Should even that not end it within a few seconds more, the process
ends with ``os._exit``: code 1 after an uncaught exception, else 0 (the argument of a ``sys.exit``
is not visible to exit hooks). A last backstop that needs no GIL (``faulthandler``) prints every
thread's stack and exits with 1 should the deadline's own thread never get to run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Final

import torch
import torch.distributed as dist

__all__ = ["ExitDeadline", "end_groups", "shutdown_sockets", "socket_inodes"]

log = logging.getLogger(__name__)

#: Devices whose backend a group may hold (gloo and mpi on cpu; nccl on cuda).
_BACKEND_DEVICES: Final = ("cpu", "cuda")
#: Seconds given to the exit after the groups' connections were shut down: a collective whose
#: connection closes fails within milliseconds (measured in sarcomm.worker.library.comm.abort_backend).
SOCKETS_GRACE_S: Final = 5.0


def end_groups(groups: list[dist.ProcessGroup]) -> None:
    """Destroy each group of ``groups`` through ``torch.distributed`` (the default group may be
    among them), holding the groups' backends meanwhile, then let the backends go with the GIL
    released (see the module's doc). Blocks until the backends' threads ended.

    ``groups`` is emptied: it must hold the only references the caller has, because a group object
    still referenced afterwards would be destroyed later, with the GIL held again.
    """
    held = _backends_of(groups)
    try:
        while groups:
            dist.destroy_process_group(groups.pop(0))
    finally:
        # Each is now the last reference: its binding releases the GIL in the destructor.
        while held:
            held.pop()


def _backends_of(groups: Iterable[dist.ProcessGroup]) -> list[object]:
    held: list[object] = []
    for group in groups:
        get_backend = getattr(group, "_get_backend", None)
        if get_backend is None:  # a torch without per-device backends: nothing to hold
            continue
        for device in _BACKEND_DEVICES:
            try:
                backend = get_backend(torch.device(device))
            except (RuntimeError, ValueError):  # no backend for that device in this group
                continue
            if all(backend is not other for other in held):
                held.append(backend)
    return held


class ExitDeadline:
    """``with ExitDeadline(seconds, sockets, label): end the groups`` ends the process within
    ``seconds`` plus :data:`SOCKETS_GRACE_S` whatever the body does (see the module's doc).

    ``sockets`` are the ``socket:[inode]`` links of the groups' connections (their
    :func:`socket_inodes` at creation); ``label`` names the process in the log lines. Only for the
    exit hook: past the deadline it shuts those connections down, and later ends the process.
    """

    def __init__(self, seconds: float, sockets: frozenset[str], label: str) -> None:
        self.seconds = seconds
        self._sockets = sockets
        self._label = label
        self._done = threading.Event()

    def __enter__(self) -> ExitDeadline:
        # Needs no GIL: fires even if the thread below can never run.
        faulthandler.dump_traceback_later(self.seconds + 2 * SOCKETS_GRACE_S, exit=True)
        watcher = threading.Thread(target=self._watch, name="sarcomm-exit-deadline", daemon=True)
        try:
            watcher.start()
        except RuntimeError as exc:  # an interpreter that refuses new threads while it finalizes
            log.warning(
                "%s: no exit deadline thread (%s); the faulthandler backstop remains", self._label, exc
            )
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        if self._done.wait(self.seconds):
            return
        closed = shutdown_sockets(self._sockets)
        log.warning(
            "%s: ending the process groups at exit took longer than %g s (SAR_EXIT_TIMEOUT); shut down "
            "their %d connection(s) so that what waits on them fails",
            self._label, self.seconds, closed,
        )  # fmt: skip
        if self._done.wait(SOCKETS_GRACE_S):
            return
        code = exit_code_so_far()
        log.error(
            "%s: the process groups did not end within %g s of their connections' shutdown; exiting "
            "with code %d without them",
            self._label, SOCKETS_GRACE_S, code,
        )  # fmt: skip
        _flush_output()
        # The exit hook cannot return and the interpreter cannot finish: ending the process here
        # is the only way left to keep the exit bounded (the agent and the user wait for it).
        os._exit(code)


def exit_code_so_far() -> int:
    """The status an exiting interpreter returns, as far as an exit hook can know it: 1 when the
    main program ended with an uncaught exception (the interpreter printed it and set
    ``sys.last_value``), else 0."""
    return 1 if getattr(sys, "last_value", None) is not None else 0


def _flush_output() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or replaced oddly
            stream.flush()


def socket_inodes() -> dict[int, str]:
    """This process's socket descriptors: fd -> ``socket:[inode]`` (empty where /proc is missing)."""
    found: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            found[int(fd)] = link
    return found


def shutdown_sockets(inodes: frozenset[str]) -> int:
    """``shutdown(SHUT_RDWR)`` every connected socket among ``inodes``; returns how many."""
    closed = 0
    for fd, link in socket_inodes().items():
        if link not in inodes:
            continue
        try:
            # A duplicate descriptor: shutdown acts on the socket itself, and closing the duplicate
            # leaves the backend's own descriptor open (it gets errors, not a reused fd number).
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:  # not connected (any more), or not a TCP socket
            pass
        finally:
            sock.close()
    return closed
