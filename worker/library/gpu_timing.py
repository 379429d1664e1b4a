"""GPU-true durations on nccl: torch's completion hook of each process group.

On nccl a collective returns once it is enqueued, so the time of the call is the launch time (a
1 GiB all_reduce "takes" microseconds). With ``TORCH_NCCL_ENABLE_TIMING=1`` ProcessGroupNCCL
records a CUDA event pair around each work's NCCL kernel and, once the work completed, calls the
hook registered with ``ProcessGroup._register_on_completion_hook`` with a ``WorkInfo``:
``active_duration`` is the time between those events on the GPU, the figure recorded here (the
NCCL kernel's time on its stream, without the wait behind earlier work on that stream).

The hook gets every work of the group, the library's calls included, but no sizes: the zero-code
kernels (:mod:`.zerocode`) note each work they see in enqueue order (:meth:`GroupTiming.expect`)
with its stats and bytes; the hook takes the oldest note of the same op type. A work noted as the
library's own is skipped (its wrapper recorded it); one with no note (enqueued past the kernels)
is recorded under its op type's label with no bytes.

The hook runs on ProcessGroupNCCL's hook thread, and torch aborts the group's communicators when
it raises: :meth:`GroupTiming.on_completion` catches everything and hands it to ``on_error``,
which turns zero-code metrics off with one line. Registering needs timing on (torch raises
otherwise) and no other hook: where the user registers one later, their hook is chained behind
ours (:func:`chain_user_hooks`), never refused.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from sarcomm.worker.library.metrics import CollectiveStats, collective_stats
from sarcomm.worker.progress import ProgressWriter

__all__ = ["OP_TYPE_LABELS", "GroupTiming", "Groups", "WorkInfoLike", "hook_decision"]

#: torch's ``OpType`` names -> the library's op labels.
OP_TYPE_LABELS: Final[dict[str, str]] = {
    "BROADCAST": "broadcast",
    "ALLREDUCE": "all_reduce",
    "ALLREDUCE_COALESCED": "all_reduce",
    "_ALLREDUCE_SPARSE": "all_reduce",
    "REDUCE": "reduce",
    "ALLGATHER": "all_gather",
    "_ALLGATHER_BASE": "all_gather",
    "ALLGATHER_COALESCED": "all_gather",
    "GATHER": "gather",
    "SCATTER": "scatter",
    "REDUCE_SCATTER": "reduce_scatter",
    "_REDUCE_SCATTER_BASE": "reduce_scatter",
    "REDUCE_SCATTER_TENSOR_COALESCED": "reduce_scatter",
    "ALLTOALL": "all_to_all",
    "ALLTOALL_BASE": "all_to_all",
    "SEND": "send",
    "RECV": "recv",
    "RECVANYSOURCE": "recv",
    "BARRIER": "barrier",
    "COALESCED": "coalesced",
}

#: Notes kept per group at most: a hook that stopped coming (timing off after all) must not grow
#: memory without bound; the oldest note goes first.
MAX_PENDING: Final = 4096


class WorkInfoLike(Protocol):
    """What the hook reads of torch's ``WorkInfo``."""

    @property
    def op_type(self) -> Any: ...

    @property
    def active_duration(self) -> datetime.timedelta: ...

    @property
    def time_started(self) -> datetime.datetime: ...

    @property
    def time_finished(self) -> datetime.datetime: ...


@dataclass(frozen=True)
class _Note:
    op_type: str
    stats: CollectiveStats | None  # None: the library's own call, recorded by its wrapper
    nbytes: int
    writer: ProgressWriter | None


def hook_decision(backend: str, has_user_hook: bool) -> str:
    """How a group's CUDA works are timed: "hook" (nccl, no hook of the user's yet), else the
    reason the hook cannot be used, said once by the caller. Whether timing is on, torch itself
    checks when the hook is registered (its error is the reason then)."""
    if backend != "nccl":
        return f"its CUDA backend is {backend}, not nccl, which alone has a completion hook"
    if has_user_hook:
        return "the script registered its own completion hook on the group first"
    return "hook"


class GroupTiming:
    """The notes and the hook of one process group."""

    def __init__(self, backend: str, on_error: Callable[[BaseException], None]) -> None:
        self.backend = backend
        self._on_error = on_error
        self._notes: deque[_Note] = deque()
        self._lock = threading.Lock()
        self.user_hooks: list[Callable[[Any], None]] = []

    def expect(
        self, op_type: str, stats: CollectiveStats | None, nbytes: int, writer: ProgressWriter | None
    ) -> None:
        """Note a work just enqueued (``stats`` None: the library's own, not to be recorded)."""
        with self._lock:
            if len(self._notes) >= MAX_PENDING:
                self._notes.popleft()
            self._notes.append(_Note(op_type, stats, nbytes, writer))

    def on_completion(self, info: WorkInfoLike) -> None:
        """torch's completion hook. Never raises (torch would abort the communicators)."""
        self._guarded(self._record, info)
        for hook in self.user_hooks:  # the user's hooks, isolated as ours
            self._guarded(hook, info)

    def _guarded(self, hook: Callable[[Any], None], info: WorkInfoLike) -> None:
        # Whatever it is, it must not reach torch; nor may the error path's own error.
        try:
            hook(info)
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                self._on_error(exc)

    def _take(self, op_type: str) -> _Note | None:
        with self._lock:
            for index, note in enumerate(self._notes):
                if note.op_type == op_type:
                    del self._notes[index]
                    return note
        return None

    def _record(self, info: WorkInfoLike) -> None:
        op_type = getattr(info.op_type, "name", str(info.op_type))
        note = self._take(op_type)
        if note is not None and note.writer is not None:
            note.writer.leave()
        if note is not None and note.stats is None:
            return
        duration = info.active_duration.total_seconds()
        if duration <= 0.0:  # no GPU events for this work: enqueue to completion as torch saw it
            duration = max((info.time_finished - info.time_started).total_seconds(), 0.0)
        if note is not None and note.stats is not None:
            stats, nbytes = note.stats, note.nbytes
        else:
            stats, nbytes = collective_stats(OP_TYPE_LABELS.get(op_type, op_type.lower()), self.backend), 0
        stats.record(round(duration * 1e9), nbytes)


class Groups:
    """The :class:`GroupTiming` of every process group seen on CUDA, by group name (None: its
    works cannot be timed on the GPU, said once through ``say``). A group is torch's
    ``ProcessGroup``: its ``group_name`` and ``_register_on_completion_hook`` are used."""

    def __init__(self, on_error: Callable[[BaseException], None], say: Callable[[str], None]) -> None:
        self._on_error = on_error
        self._say = say
        self._by_name: dict[str, GroupTiming | None] = {}
        self._user_hooked: set[str] = set()
        self._lock = threading.Lock()
        #: torch's own registration (kept by :meth:`patch` before it replaces the method).
        self._register: Callable[[Any, Callable[[Any], None]], None] = _register_directly

    def timing(self, group: Any, backend: str) -> GroupTiming | None:
        """The group's timing, registering the hook on first sight."""
        name = group.group_name
        if name in self._by_name:
            return self._by_name[name]
        with self._lock:
            decision = hook_decision(backend, name in self._user_hooked)
            timing: GroupTiming | None = None
            if decision == "hook":
                candidate = GroupTiming(backend, self._on_error)
                try:
                    self._register(group, candidate.on_completion)
                except RuntimeError as exc:
                    decision = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                else:
                    timing = candidate
            if timing is None:
                self._say(f"process group {name}: collectives on CUDA tensors are not timed ({decision})")
            self._by_name[name] = timing
            return timing

    def register_user_hook(self, group: Any, hook: Callable[[Any], None]) -> None:
        """What the script's ``_register_on_completion_hook`` does once :meth:`patch` ran: chained
        behind ours on a group we hooked, else registered as torch would."""
        with self._lock:
            timing = self._by_name.get(group.group_name)
            if timing is not None:
                timing.user_hooks.append(hook)
                return
            self._user_hooked.add(group.group_name)
        self._register(group, hook)

    def patch(self, cls: Any) -> None:
        """Route ``cls._register_on_completion_hook`` (torch's ``ProcessGroup``) through
        :meth:`register_user_hook`, so that a script's own hook is never refused for ours."""
        self._register = cls._register_on_completion_hook
        groups = self

        def register(group: Any, hook: Callable[[Any], None]) -> None:
            groups.register_user_hook(group, hook)

        cls._register_on_completion_hook = register


def _register_directly(group: Any, hook: Callable[[Any], None]) -> None:
    group._register_on_completion_hook(hook)
