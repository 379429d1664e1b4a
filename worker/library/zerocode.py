"""Zero-code metrics inside a rank: every collective its process groups run, timed into the
library's metrics, without the script importing sarcomm.

Loaded by :mod:`sarcomm.worker.autometrics.entry` (``import torch`` calls it) in a rank that
``sar-worker`` or ``torchrun --rdzv-backend=sarcomm`` started. :func:`install`:

1. starts what :func:`~sarcomm.worker.library.services.start_rank_services` starts for a library
   rank: the progress record its agent reads (``sar-worker``), the ``/metrics`` endpoint on the
   usual port rules, and its note for the torchrun agent, so ``/sd`` lists it;
2. puts a Python kernel in front of each ``c10d`` op of torch's dispatcher, at the Autograd keys.
   ``ProcessGroup``'s C++ methods call these ops (torch 2.x, ``ProcessGroup.hpp``), so the kernel
   sees every collective of every process group: ``dist.*`` from Python, DDP's reducer and its
   ``_broadcast_coalesced`` from C++, FSDP's, the library's. It notes the start, hands the call on
   below Autograd (``redispatch``: the process group and its backend are untouched) and records
   the work's completion: on gloo (any CPU backend) from the work's future, enqueue to completion;
   on CUDA tensors from the process group's completion hook (:mod:`.gpu_timing`).

Counted once: the library's own wrappers record their calls themselves (with the op names and
byte counts of their API). On CPU tensors they run torch's collective with the AutogradCPU key
excluded (:func:`~sarcomm.worker.library.collectives.timing.set_dispatch_below`), so the kernel
never runs for them and costs them nothing; a call that still reaches it inside a wrapper (a
fallback that computes as well, a CUDA call) is passed over by a per-thread depth that the
wrappers' progress hook raises (:class:`_LibraryCall`); a CUDA one is noted as the library's for
the completion hook to skip.

Never raises of its own: an error in the bookkeeping is said once and turns the kernels into a
plain hand-over (:func:`_fail`); an error of the collective is the caller's, counted and re-raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist

from sarcomm.worker.launch_env import process_environ, rank_identity
from sarcomm.worker.library import gpu_timing, metrics, services
from sarcomm.worker.library.collectives import timing
from sarcomm.worker.progress import ProgressWriter

__all__ = ["C10D_OPS", "OpSpec", "active", "install", "library_call_depth", "set_kernels"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpSpec:
    """A ``c10d`` op the kernels time: its label (the library's op names), the argument whose
    tensors are the payload (-1: none) and which of it this rank sends, as the library counts:
    "all" of it, the "others'" parts (n - 1 of n), or all of it at the "root" only."""

    label: str
    payload_arg: int
    sends: str = "all"


#: Every ``c10d`` op of torch 2.x's ``Ops.cpp`` that moves data, by its name in the dispatcher.
C10D_OPS: Final[dict[str, OpSpec]] = {
    "allreduce_": OpSpec("all_reduce", 0),
    "allreduce_coalesced_": OpSpec("all_reduce", 0),
    "broadcast_": OpSpec("broadcast", 0, "root"),
    "allgather_": OpSpec("all_gather", 1),
    "_allgather_base_": OpSpec("all_gather", 1),
    "allgather_coalesced_": OpSpec("all_gather", 1),
    "allgather_into_tensor_coalesced_": OpSpec("all_gather", 1),
    "reduce_scatter_": OpSpec("reduce_scatter", 1, "others"),
    "_reduce_scatter_base_": OpSpec("reduce_scatter", 1, "others"),
    "reduce_scatter_tensor_coalesced_": OpSpec("reduce_scatter", 1, "others"),
    "reduce_": OpSpec("reduce", 0),
    "gather_": OpSpec("gather", 1),
    "scatter_": OpSpec("scatter", 1),
    "alltoall_": OpSpec("all_to_all", 1, "others"),
    "alltoall_base_": OpSpec("all_to_all", 1, "others"),
    "send": OpSpec("send", 0),
    "recv_": OpSpec("recv", -1),
    "barrier": OpSpec("barrier", -1),
}

#: The dispatch keys the kernels sit at: one before the backends' own (CPU, CUDA), present on
#: every tensor that is not an inference tensor.
_KEYS: Final = ("AutogradCPU", "AutogradCUDA")
_BELOW: Final = torch._C._after_autograd_keyset
_CUDA: Final = torch._C.DispatchKey.CUDA
_ProcessGroup: Final = torch._C._distributed_c10d.ProcessGroup
_Work: Final = torch._C._distributed_c10d.Work
_now = time.perf_counter_ns


class _Depth(threading.local):
    depth = 0


_tls = _Depth()


def library_call_depth() -> int:
    """How many of the library's timed calls this thread is inside (the kernels count none then)."""
    return _tls.depth


class _LibraryCall:
    """The library wrappers' progress hook while zero-code is on: it raises this thread's depth
    around each wrapped call (so the kernels leave that call to the wrapper) and forwards to the
    rank's progress writer, if any."""

    __slots__ = ("_writer",)

    def __init__(self, writer: ProgressWriter | None) -> None:
        self._writer = writer

    def enter(self, op: str) -> int:
        _tls.depth += 1
        return self._writer.enter(op) if self._writer is not None else 0

    def leave(self) -> None:
        _tls.depth -= 1
        if self._writer is not None:
            self._writer.leave()


class _State:
    on = False
    writer: ProgressWriter | None = None
    rank_label = "?"
    #: The backend label per device kind (True: CUDA tensors), found at the first call.
    backends: dict[bool, str] = {}
    stats: dict[tuple[str, str], metrics.CollectiveStats] = {}
    info_set = False
    library: torch.library.Library | None = None


_state = _State()
_groups = gpu_timing.Groups(lambda exc: _fail(exc), lambda line: _say(line))


def active() -> bool:
    """Whether the kernels are recording in this process."""
    return _state.on


def _say(line: str) -> None:
    log.warning("sarcomm: rank %s: %s", _state.rank_label, line)


def _fail(exc: BaseException) -> None:
    """Say once that zero-code metrics stop, and why; the kernels hand every call on from now."""
    if _state.on:
        _state.on = False
        log.warning(
            "sarcomm: rank %s: zero-code metrics are off: %s: %s (training goes on)",
            _state.rank_label, type(exc).__name__, exc,
        )  # fmt: skip


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _backend(cuda: bool, group: Any) -> str:
    name = _state.backends.get(cuda)
    if name is None:
        try:
            name = group._get_backend(torch.device("cuda" if cuda else "cpu")).name()
        except RuntimeError:  # a group of one backend for every device
            name = group.name()
        _state.backends[cuda] = name
        if not _state.info_set or name == "nccl":
            _set_info(name)
    return str(name)


def _set_info(backend: str) -> None:
    identity = rank_identity(process_environ())
    metrics.set_worker_info(
        job=identity.job,
        rank=dist.get_rank() if dist.is_initialized() else int(identity.rank or 0),
        world_size=dist.get_world_size() if dist.is_initialized() else 0,
        backend=backend,
        generation=identity.generation,
    )
    _state.info_set = True


def _stats(label: str, backend: str) -> metrics.CollectiveStats:
    key = (label, backend)
    stats = _state.stats.get(key)
    if stats is None:
        stats = _state.stats[key] = metrics.collective_stats(label, backend)
    return stats


def _on_done(
    stats: metrics.CollectiveStats, start: int, nbytes: int, writer: ProgressWriter | None
) -> Callable[[Any], None]:
    def done(future: Any) -> None:
        # Runs on the backend's thread when the work completes; it must never raise there.
        try:
            if writer is not None:
                writer.leave()
            try:
                future.value()
            except Exception:
                stats.error()
                return
            stats.observe(start, nbytes)
        except Exception as exc:
            _fail(exc)

    return done


def _sent(spec: OpSpec, args: tuple[Any, ...], group_arg: int, root_arg: int) -> int:
    """The bytes this rank sends in the call, as the library's wrappers count them."""
    if spec.payload_arg < 0:
        return 0
    nbytes = _nbytes(args[spec.payload_arg])
    if spec.sends == "others":
        size = _ProcessGroup.unbox(args[group_arg]).size()
        return nbytes * (size - 1) // size if size > 0 else 0
    if spec.sends == "root":
        return nbytes if _ProcessGroup.unbox(args[group_arg]).rank() == args[root_arg] else 0
    return nbytes


def _make_kernel(overload: Any, spec: OpSpec, group_arg: int, root_arg: int) -> Callable[..., Any]:
    redispatch = overload.redispatch
    label = spec.label

    def kernel(keyset: Any, *args: Any) -> Any:
        below = keyset & _BELOW
        if not _state.on:
            return redispatch(below, *args)
        cuda = keyset.has(_CUDA)
        if _tls.depth and not cuda:  # the library's wrapper records it
            return redispatch(below, *args)
        try:
            # Unboxing the group costs microseconds: only on first sight of a device kind, for
            # CUDA works (their group's hook) and for the ops whose bytes depend on it.
            backend = _state.backends.get(cuda)
            if backend is None:
                backend = _backend(cuda, _ProcessGroup.unbox(args[group_arg]))
            stats = _stats(label, backend)
            nbytes = _sent(spec, args, group_arg, root_arg)
            writer = _state.writer if not _tls.depth else None
            timing = _groups.timing(_ProcessGroup.unbox(args[group_arg]), backend) if cuda else None
        except Exception as exc:
            _fail(exc)
            return redispatch(below, *args)
        if writer is not None:
            writer.enter(label)
        start = _now()
        try:
            out = redispatch(below, *args)
        except Exception:
            if not _tls.depth:
                stats.error()
            if writer is not None:
                writer.leave()
            raise
        try:
            work: Any = _Work.unbox(out[-1] if isinstance(out, tuple) else out)
            if cuda:
                if timing is not None:
                    op_type = work._get_op_type().name
                    timing.expect(op_type, None if _tls.depth else stats, nbytes, writer)
                elif writer is not None:
                    writer.leave()
            else:
                try:
                    future = work.get_future()
                except RuntimeError:  # a work without a future (a gloo send): timed to return
                    stats.observe(start, nbytes)
                    if writer is not None:
                        writer.leave()
                else:
                    future.add_done_callback(_on_done(stats, start, nbytes, writer))
        except Exception as exc:
            _fail(exc)
        return out

    return kernel


def _register() -> torch.library.Library:
    library = torch.library.Library("c10d", "IMPL")  # type: ignore[no-untyped-call]
    for name, spec in C10D_OPS.items():
        packet = getattr(torch.ops.c10d, name, None)
        if packet is None:  # an op this torch does not have
            continue
        overload = packet.default
        names = [a.name for a in overload._schema.arguments]
        root = names.index("root_rank") if "root_rank" in names else -1
        kernel = _make_kernel(overload, spec, names.index("process_group"), root)
        for key in _KEYS:
            library.impl(name, kernel, key, with_keyset=True)  # type: ignore[no-untyped-call]
    return library


def _set_writer(writer: ProgressWriter | None) -> None:
    _state.writer = writer
    timing.set_progress_hook(_LibraryCall(writer))


def install(launcher: str) -> None:
    """Instrument this rank (``launcher``: who started it, for the log line). Raises what goes
    wrong; the entry point says it and leaves the rank as it was."""
    if _state.on:  # a second entry point loading this in one process
        return
    env = process_environ()
    _state.rank_label = rank_identity(env).rank_label
    # After the collectives' own listener (registered when they were imported): the wrappers'
    # hook becomes the depth counter around the rank's progress writer, now and if it changes.
    _set_writer(None)
    services.add_progress_listener(_set_writer)
    services.start_rank_services(env, zero_code=True)
    _groups.patch(_ProcessGroup)
    _state.library = _register()
    timing.set_dispatch_below(True)
    _state.on = True
    log.debug("sarcomm: rank %s (%s): zero-code metrics on", _state.rank_label, launcher)


def set_kernels(on: bool) -> None:
    """Register (True) or remove (False) the dispatcher kernels of an instrumented rank: removed, a
    collective runs exactly as without sarcomm. For benchmarks that compare both in one process
    (``benchmarks/zerocode.py``); nothing else calls it."""
    if on and _state.library is None:
        _state.library = _register()
    elif not on and _state.library is not None:
        _state.library._destroy()  # type: ignore[no-untyped-call]
        _state.library = None
    timing.set_dispatch_below(on)


# The module is imported by the entry point only; keep a reference to dist so that the c10d ops
# are registered (torch.distributed loads them) before _register looks them up.
_ = dist.is_available
