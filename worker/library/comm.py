"""Process-wide communication state and start-up: SAR's ``initialize_comms`` and its getters.

Mirrors ``sar.comm.initialize_comms`` of IntelLabs/SAR (same positional signature, same effect on
``MASTER_ADDR``/``MASTER_PORT`` and the backends' interface variables, an already initialised
process group left alone) with these differences, each on purpose:

- ``master_port_number=None`` means the port the coordinator handed out, which the start-up code
  exports as ``MASTER_PORT``; SAR's fixed default 12345 collides between jobs on one host.
- The interface comes from ``SAR_SOCKET_NAME`` only (which ``sar-worker`` always sets). SAR's
  fallback, "the first adapter whose name contains eth or enp", is the fragile guess this project
  replaces, so without ``SAR_SOCKET_NAME`` the backends keep their own defaults. Interface variables
  the user set explicitly are never overridden.
- ``gloo``, ``ucc`` and ``auto`` are accepted besides ``nccl``, ``ccl`` and ``mpi``; an unavailable
  backend is an :class:`InvalidArgumentError` that says why and names the available ones.
- The process group always gets an explicit timeout (``SAR_COLLECTIVE_TIMEOUT`` seconds, default
  300) instead of gloo's 30 minutes.
- When the coordinator reports a failed peer (:func:`mark_peer_failed`), the process group is
  aborted so that a collective already waiting raises too (see :func:`abort_backend`).
- With ``nccl`` a second, gloo process group over the same ranks carries CPU tensors, which NCCL
  cannot move; the collectives route to it by the tensor's device.
- SAR's writes of ``MPI_COMM_WORLD``, ``OMPI_COMM_WORLD`` and similar variables are left out: no MPI
  implementation reads those names.

The decisions (backend, device, routing) are pure functions of their inputs, in
:mod:`sarcomm.worker.library.backends`, so that they are unit-tested without GPUs or a process
group; what the environment says (the timeouts, the master port, ``LOCAL_RANK``, the interface
variables) is read by :mod:`sarcomm.worker.launch_env`, from the mapping :func:`initialize_comms`
takes from ``process_environ()``.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import logging
import threading
from typing import Any, Final, cast

import torch
import torch.distributed as dist

import sarcomm.worker as _package
from sarcomm.common.errors import FailedPreconditionError, InvalidArgumentError, PeerFailedError, shorten
from sarcomm.worker.launch_env import (
    collective_timeout_setting,
    exit_timeout_setting,
    interface_setting,
    local_rank_setting,
    master_environment,
    master_port_setting,
    process_environ,
    rank_identity,
    required_master_port,
    socket_environment,
)
from sarcomm.worker.library import cuda_events, metrics, registration, sar_keywords
from sarcomm.worker.library.backends import (
    CCL_MODULE,
    adopted_backend,
    choose_backend,
    choose_comm_device,
    local_rank_from,
    needs_cpu_side_group,
    probe_backends,
)
from sarcomm.worker.library.services import start_rank_services
from sarcomm.worker.library.teardown import ExitDeadline, end_groups, shutdown_sockets, socket_inodes

__all__ = [
    "OPS",
    "STATE",
    "CommState",
    "abort_backend",
    "backend",
    "comm_device",
    "destroy_comms",
    "initialize_comms",
    "is_initialized",
    "mark_peer_failed",
    "master_ip",
    "master_port",
    "peer_failure_after",
    "rank",
    "world_size",
]

log = logging.getLogger(__name__)

#: Every op label the collectives record under; their stats are resolved once per backend.
OPS: Final = (
    "all_to_all",
    "all_reduce",
    "exchange_tensors",
    "exchange_single_tensor",
    "sync_params",
    "gather_grads",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
)


class CommState:
    """The process-wide communication state. One instance, :data:`STATE`, mutated in place (never
    rebound) so that modules holding a reference see every change. Read by
    ``sarcomm.worker.library.collectives`` on every call; written only by this module."""

    __slots__ = (
        "backend",
        "backend_sockets",
        "comm_device",
        "cpu_backend",
        "cpu_group",
        "cpu_stats",
        "cuda_events",
        "exit_timeout",
        "initialized",
        "master_addr",
        "master_port",
        "owns_group",
        "peer_failure",
        "rank",
        "ready",
        "stats",
        "world_size",
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Back to the state of a process that never called initialize_comms."""
        self.initialized = False
        #: initialized and no peer failure known: the one flag the collectives test per call.
        self.ready = False
        #: Set by mark_peer_failed; raised by every later collective.
        self.peer_failure: PeerFailedError | None = None
        self.rank = 0
        self.world_size = 1
        self.backend = ""
        self.comm_device = torch.device("cpu")
        self.master_addr = ""
        self.master_port = 0
        #: gloo group over all ranks for CPU tensors when the default group cannot carry them.
        self.cpu_group: dist.ProcessGroup | None = None
        self.cpu_backend = ""
        #: Whether initialize_comms created the default group (and so destroy_comms may end it).
        self.owns_group = False
        #: op -> stats for the default group's backend, and for the CPU side group's.
        self.stats: dict[str, metrics.CollectiveStats] = {}
        self.cpu_stats: dict[str, metrics.CollectiveStats] = {}
        #: The CUDA events timing the library's calls on CUDA tensors (a CUDA comm device only).
        self.cuda_events: cuda_events.EventTimer | None = None
        #: The sockets (``socket:[inode]``) the process groups opened: gloo's connections to the
        #: peers and the store's; abort_backend shuts them down.
        self.backend_sockets: frozenset[str] = frozenset()
        #: Seconds the exit hook may take to end the groups (SAR_EXIT_TIMEOUT).
        self.exit_timeout = 0.0


#: The state of this process. Internal to sarcomm.worker: use the getters below.
STATE: Final = CommState()


def initialize_comms(
    rank: int | None = None,
    world_size: int | None = None,
    master_ip_address: str | None = None,
    backend: str | None = None,
    comm_device: torch.device | str | None = None,
    master_port_number: int | None = None,
    *,
    _rank: int | None = None,
    _world_size: int | None = None,
    _comm_device: torch.device | str | None = None,
) -> None:
    """Initialise ``torch.distributed`` for this rank, as SAR's ``initialize_comms`` does.

    ``rank``, ``world_size``, ``master_ip_address`` and ``backend`` are required; SAR's keyword
    names ``_rank``, ``_world_size`` and ``_comm_device`` are accepted for ``rank``,
    ``world_size`` and ``comm_device`` (both spellings of one argument: ``TypeError``).

    ``backend`` is one of ``auto``, ``gloo``, ``nccl``, ``ccl``, ``mpi``, ``ucc``.
    ``comm_device`` defaults to ``cuda:LOCAL_RANK`` for nccl and ``cpu`` otherwise.
    ``master_port_number=None`` takes ``MASTER_PORT`` from the environment (the coordinator's port).

    Sets ``MASTER_ADDR`` and ``MASTER_PORT``; fills the backends' interface variables from
    ``SAR_SOCKET_NAME`` where the user has not set them. When a process group already exists it is
    left alone (its backend wins over ``backend``) and only this module's state is filled in.
    Otherwise blocks until all ``world_size`` ranks have joined, at most ``SAR_COLLECTIVE_TIMEOUT``
    seconds (default 300), the timeout every later collective gets too. All ranks must call this:
    with nccl it also creates the CPU side group, a collective step.

    Raises :class:`InvalidArgumentError` for a bad rank, world size, address, port, backend, device
    or timeout, and whatever ``torch.distributed`` raises when the rendezvous fails.
    """
    func = "initialize_comms"
    rank = sar_keywords.required(func, "rank", rank, "_rank", _rank)
    world_size = sar_keywords.required(func, "world_size", world_size, "_world_size", _world_size)
    device_arg = sar_keywords.one_of(func, "comm_device", comm_device, "_comm_device", _comm_device)
    comm_device = cast("torch.device | str | None", device_arg)
    if master_ip_address is None or backend is None:
        missing = "master_ip_address" if master_ip_address is None else "backend"
        raise TypeError(f"initialize_comms() missing required argument {missing!r}.")
    _check_rank(rank, world_size)
    if not isinstance(master_ip_address, str) or not master_ip_address.strip():
        raise InvalidArgumentError(
            f"master_ip_address={shorten(master_ip_address)} must be a non-empty host name or IP address."
        )
    environ = process_environ()
    probe = probe_backends()
    timeout = datetime.timedelta(seconds=collective_timeout_setting(environ))
    exit_seconds = exit_timeout_setting(environ)
    identity = rank_identity(environ)
    job, generation = identity.job, identity.generation

    if dist.is_initialized():
        port = STATE.master_port or master_port_setting(environ, None) or 0
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise InvalidArgumentError(
                f"rank {rank} of world size {world_size} does not match the process group that is "
                f"already initialised (rank {dist.get_rank()} of {dist.get_world_size()})."
            )
        device_hint = torch.device(comm_device) if comm_device is not None else None
        name, group_carries_cpu = adopted_backend(str(dist.get_backend()), device_hint, probe)
        if backend not in ("auto", name):
            log.warning(
                "job %s rank %s generation %s: process group already initialised with backend %s; "
                "keeping it and ignoring backend=%r",
                job, rank, generation, name, backend,
            )  # fmt: skip
        owns_group = STATE.owns_group and STATE.initialized
    else:
        name = choose_backend(backend, probe)
        port = required_master_port(environ, master_port_number)
        if name == "ccl":
            _import_ccl()
        environ.update(master_environment(master_ip_address, port))
        environ.update(socket_environment(environ))
        owns_group = True
        group_carries_cpu = not needs_cpu_side_group(name)

    local_rank = local_rank_from(rank, probe, local_rank_setting(environ))
    device = choose_comm_device(name, comm_device, local_rank, probe)
    if device.type == "cuda":
        # Collectives without an explicit device (barrier, object collectives) use the current one.
        torch.cuda.set_device(device)
    sockets_before = socket_inodes() if not dist.is_initialized() else None
    if not dist.is_initialized():
        interface = interface_setting(environ)
        log.info(
            "job %s rank %s generation %s: initialising %s process group of %s ranks via %s:%s "
            "(timeout %.0f s, interface %s)",
            job, rank, generation, name, world_size, master_ip_address, port,
            timeout.total_seconds(), "backend default" if interface is None else interface,
        )  # fmt: skip
        dist.init_process_group(
            backend=name, init_method="env://", rank=rank, world_size=world_size, timeout=timeout
        )

    cpu_group: dist.ProcessGroup | None = STATE.cpu_group if STATE.initialized else None
    if not group_carries_cpu and cpu_group is None:
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    if sockets_before is not None:
        # What the new groups opened (gloo connects every pair at creation): only these are shut
        # down on abort, never the coordinator's connection or the user's own sockets.
        STATE.backend_sockets = frozenset(socket_inodes().values()) - frozenset(sockets_before.values())

    STATE.rank, STATE.world_size, STATE.backend, STATE.comm_device = rank, world_size, name, device
    STATE.master_addr, STATE.master_port, STATE.owns_group = master_ip_address, port, owns_group
    STATE.cpu_group, STATE.exit_timeout = cpu_group, exit_seconds
    STATE.cpu_backend = "gloo" if cpu_group is not None else name
    STATE.stats = {op: metrics.collective_stats(op, name) for op in OPS}
    STATE.cpu_stats = {op: metrics.collective_stats(op, STATE.cpu_backend) for op in OPS}
    if device.type == "cuda":
        STATE.cuda_events = cuda_events.for_cuda(lambda line: log.warning("rank %s: %s", rank, line))
        metrics.set_before_scrape("cuda_events", STATE.cuda_events.poll)
    STATE.initialized = True
    STATE.peer_failure = None
    _failure_known.clear()
    STATE.ready = True
    _destroy_at_exit()
    metrics.set_worker_info(job=job, rank=rank, world_size=world_size, backend=name, generation=generation)
    # Once the process group is up: the metrics endpoint then has a worker identity to show.
    start_rank_services(environ)
    side = ", CPU tensors via gloo side group" if cpu_group is not None else ""
    log.info(
        "job %s rank %s generation %s: communication ready (backend %s, comm device %s%s)",
        job, rank, generation, name, device, side,
    )  # fmt: skip


def _check_rank(rank_: int, world_size_: int) -> None:
    if isinstance(world_size_, bool) or not isinstance(world_size_, int) or world_size_ < 1:
        raise InvalidArgumentError(f"world_size={shorten(world_size_)} must be an integer of at least 1.")
    if isinstance(rank_, bool) or not isinstance(rank_, int) or not 0 <= rank_ < world_size_:
        raise InvalidArgumentError(
            f"rank={shorten(rank_)} must be an integer in 0..world_size-1 (world_size={world_size_})."
        )


def _import_ccl() -> None:
    # Importing the bindings registers the "ccl" backend with torch.distributed.
    try:
        importlib.import_module(CCL_MODULE)
    except ImportError as exc:
        raise InvalidArgumentError(
            f"backend 'ccl' is not available: importing {CCL_MODULE} failed: {exc}."
        ) from exc


def destroy_comms() -> None:
    """Forget the state; destroy the CPU side group, and the default process group too when
    :func:`initialize_comms` created it (one it found already there is left to its owner).
    Afterwards :func:`initialize_comms` may be called again, e.g. for a new generation.

    Safe on every torch sarcomm admits: the groups' backends end with the GIL released (torch
    before 2.8 ended them holding it, which deadlocks with a gloo thread freeing a tensor; see
    :mod:`sarcomm.worker.library.teardown`)."""
    groups: list[dist.ProcessGroup] = []
    if dist.is_initialized():
        if STATE.cpu_group is not None:
            groups.append(STATE.cpu_group)
        if STATE.owns_group:
            groups.append(_default_group())
    if STATE.cuda_events is not None:  # pending events are forgotten, never waited for
        STATE.cuda_events.close()
        metrics.set_before_scrape("cuda_events", None)
    STATE.reset()  # drops STATE's reference to the side group: end_groups must hold the last one
    end_groups(groups)


def _default_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:  # is_initialized() said there is one
        raise FailedPreconditionError("torch.distributed has no default process group to destroy.")
    return group


_exit_hook_installed = False


def _destroy_at_exit() -> None:
    """Destroy the groups at interpreter exit, once registered: a process that exits with gloo's
    threads still running is aborted by torch's C++ runtime ("terminate called without an active
    exception", SIGABRT), which turns a clean exit 0 into a crash for the agent. The hook runs under
    a deadline (``SAR_EXIT_TIMEOUT``, :class:`~sarcomm.worker.library.teardown.ExitDeadline`): an exit
    never hangs, even when a collective still waits for a silent peer."""
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True

    def destroy() -> None:
        if not STATE.initialized:
            return
        label = f"job {rank_identity(process_environ()).job} rank {STATE.rank}"
        with ExitDeadline(STATE.exit_timeout, STATE.backend_sockets, label):
            try:
                destroy_comms()
            except Exception as exc:  # exiting anyway: report, do not mask the exit status
                log.warning("destroying the process group at exit failed: %s", exc)

    atexit.register(destroy)


def mark_peer_failed(error: PeerFailedError) -> None:
    """Record that a peer failed (the client's watchdog calls this, from its own thread). From
    then on every sarcomm collective raises ``error`` at once instead of entering a call that cannot
    finish; the process group is aborted (:func:`abort_backend`), so that a collective already
    waiting for the failed peer fails within moments and is re-raised as ``error``. Cleared by
    initialize_comms (the process group must be made anew: an aborted one is unusable)."""
    first = STATE.peer_failure is None
    STATE.peer_failure = error
    STATE.ready = False
    _failure_known.set()
    if first and STATE.initialized:
        abort_backend()


#: Set when a peer failure is known; a collective whose backend failed waits on it for the verdict.
_failure_known = threading.Event()


def peer_failure_after(exc: BaseException) -> PeerFailedError | None:
    """The peer failure to raise instead of ``exc``, a backend error of a collective, if any.

    A peer that died closes its connections, so gloo fails the collective with "Connection closed
    by peer" a moment *before* the coordinator has judged the peer. When a coordinator watches this
    process (it registered itself), the coordinator's verdict is waited for, at most
    :func:`sarcomm.worker.library.registration.peer_verdict_wait` seconds, so that the caller gets
    :class:`PeerFailedError` naming the rank, host and reason rather than gloo's message. None when
    no failure is known (then ``exc`` stands).
    """
    failure = STATE.peer_failure
    if failure is not None or not isinstance(exc, RuntimeError):
        return failure
    wait = registration.peer_verdict_wait()
    if wait > 0:
        _failure_known.wait(wait)
    return STATE.peer_failure


def abort_backend() -> None:
    """Make collectives that are waiting in the backend fail now; the groups are unusable after.

    - nccl (and other backends that implement it): ``ProcessGroup.abort()``.
    - gloo: torch 2.13's ``ProcessGroupGloo.abort()`` and ``shutdown()`` return at once but leave
      a collective that waits for a silent peer blocked until the group's timeout (measured: a
      two-rank all_reduce stayed blocked until the peer exited), and
      ``distributed_c10d._abort_process_group`` is documented for NCCL only. What does unblock it is
      its sockets: ``shutdown(SHUT_RDWR)`` of each connection the groups opened (gloo's pairs and
      the store's) makes gloo's pending reads fail with "Connection closed by peer", and the
      collective raises within milliseconds. Listening sockets are left alone (shutting down
      gloo's listener makes its accept thread terminate the process), as is every socket opened
      outside the groups' creation (the coordinator's connection, the user's own).

    Called from the watchdog's thread while the main thread may be inside a collective: it only
    signals the backend and touches sockets, never torch's group registry.
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not None and STATE.backend != "gloo":
        try:
            world.abort()
        except Exception as exc:  # best effort: the sockets below still unblock the CPU side group
            log.warning("aborting the %s process group failed: %s", STATE.backend, exc)
    closed = shutdown_sockets(STATE.backend_sockets)
    log.warning(
        "rank %s: aborted the process group after a peer failure (%d connection(s) shut down)",
        STATE.rank, closed,
    )  # fmt: skip


def _state() -> CommState:
    if not STATE.initialized:
        raise FailedPreconditionError(
            "sarcomm communication is not initialised in this process: call initialize_comms(...) "
            "(or sar.init()) first."
        )
    return STATE


def is_initialized() -> bool:
    """True once :func:`initialize_comms` has run in this process (and no :func:`destroy_comms`)."""
    return STATE.initialized


def rank() -> int:
    """This process's rank. Raises :class:`FailedPreconditionError` before initialize_comms."""
    return _state().rank


def world_size() -> int:
    """Number of ranks. Raises :class:`FailedPreconditionError` before initialize_comms."""
    return _state().world_size


def backend() -> str:
    """The backend of the default process group, e.g. ``gloo`` (``auto`` resolved). Raises
    :class:`FailedPreconditionError` before initialize_comms."""
    return _state().backend


def comm_device() -> torch.device:
    """The device tensors must be on for the backend: ``cpu`` for gloo, mpi, ucc and ccl,
    ``cuda:<local rank>`` for nccl unless initialize_comms was given another. Raises
    :class:`FailedPreconditionError` before initialize_comms."""
    return _state().comm_device


def master_ip() -> str:
    """The master address initialize_comms was given. Raises :class:`FailedPreconditionError`
    before initialize_comms."""
    return _state().master_addr


def master_port() -> int:
    """The master port in use (0 when an existing group was adopted without MASTER_PORT). Raises
    :class:`FailedPreconditionError` before initialize_comms."""
    return _state().master_port


# A coordinator that watches this process (it registered itself) reports failed peers from its
# heartbeat thread: collectives then raise at once instead of waiting for a peer that is gone.
registration.add_peer_failure_listener(mark_peer_failed)


def __getattr__(name: str) -> Any:
    # SAR's code calls its collectives as ``sar.comm.all_reduce(...)``: with ``import
    # sarcomm.worker as sar`` that is this module, so SAR's names that live elsewhere resolve here.
    if name in sar_keywords.SAR_COMM_NAMES_ELSEWHERE:
        return getattr(_package, name)  # the package's lazy export (loaded on first use, not here)
    raise AttributeError(f"module 'sarcomm.worker.library.comm' has no attribute {name!r}")
