"""Managed start-up of a rank: :func:`init` finds out who this process is and initialises
``torch.distributed`` through :func:`sarcomm.worker.library.comm.initialize_comms`.

It reads what ``sar-worker`` set, or else the torchrun, Open MPI, MPICH/PMI or Slurm variables
(:func:`~sarcomm.worker.launch_env.parse_launch_env`), or registers the process itself when given
a coordinator (:mod:`sarcomm.worker.library.registration`, which also holds SAR's drop-in
``coord_ip_init``).

Under ``sar-worker``, :func:`init` keeps the progress record the agent reads
(``SAR_PROGRESS_FILE``, stamped every ``SARCOMM_HEARTBEAT_INTERVAL`` seconds); the agent stops the
ranks itself when a peer fails, and a rank whose agent is gone (``SAR_AGENT_PID``) stops itself
(:mod:`sarcomm.worker.library.services`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from sarcomm.common.constants import (
    BACKENDS,
    JOB_VARIABLE,
    MASTER_ADDR_VARIABLE,
    MASTER_PORT_VARIABLE,
    WORLD_SIZE_VARIABLE,
)
from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.messages import Assignment
from sarcomm.worker.launch_env import (
    LaunchEnv,
    backend_setting,
    detect_launcher,
    parse_launch_env,
    process_environ,
    progress_settings,
    rank_identity,
)
from sarcomm.worker.library import comm
from sarcomm.worker.library.registration import register
from sarcomm.worker.library.services import install_progress, start_rank_services

__all__ = ["WorkerInfo", "init"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """Who this process is in its job.

    ``backend`` is the one ``torch.distributed`` was initialised with (after "auto" was resolved)
    when :func:`init` initialised it, else the requested one. ``generation`` is the coordinator's
    world generation (0 when no coordinator is involved); ``job`` is "" then too.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str
    generation: int
    job: str
    restart_count: int


def _worker_info(source: Assignment | LaunchEnv, backend: str) -> WorkerInfo:
    """A join's assignment or a launcher's variables as a :class:`WorkerInfo`: every field but
    ``backend`` has the same name there (the caller checked that a launcher set the master)."""
    shared = {f.name: getattr(source, f.name) for f in dataclasses.fields(WorkerInfo) if f.name != "backend"}
    return WorkerInfo(backend=backend, **shared)


def init(
    coord: str | None = None,
    job: str | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    *,
    initialize: bool = True,
    timeout: float | None = None,
    token: str | None = None,
    extra_ports: int = 0,
) -> WorkerInfo:
    """Find out who this process is and (``initialize=True``) initialise ``torch.distributed``.

    - Started by ``sar-worker``: reads the variables it set (``RANK``, ``MASTER_ADDR``,
      ``SAR_*`` ...). ``coord``, ``job`` and ``world_size`` are then only checked against them.
    - ``coord`` given, or ``SAR_COORD`` set without ``RANK``: registers the process with the
      coordinator (like :func:`~sarcomm.worker.library.registration.coord_ip_init`). The rank asked for
      is the launcher's (Open MPI, MPICH, Slurm) when there is one, else any; ``job`` defaults
      to ``SAR_JOB`` and ``world_size`` to the launcher's or ``WORLD_SIZE``.
    - Otherwise: the torchrun, Open MPI, MPICH/PMI or Slurm variables (:func:`parse_launch_env`);
      ``MASTER_ADDR`` and ``MASTER_PORT`` must be set.

    ``backend`` defaults to ``SAR_BACKEND``, else "auto". ``timeout`` bounds a join (seconds;
    None: the coordinator's ``--join-timeout``); ``token`` is the coordinator's bearer token.
    ``extra_ports=K`` reserves the K ports after the master port when registering (as
    ``coord_ip_init``'s; under ``sar-worker`` its ``--extra-ports`` does).

    Raises:
        InvalidArgumentError: a variable or argument breaks its rule (the message names it, its
            value and the rule), or a needed one is missing.
        the errors of :func:`~sarcomm.worker.library.registration.coord_ip_init` when registering.
    """
    env = process_environ()
    launcher = detect_launcher(env)
    identity = rank_identity(env)
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgumentError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}.")
    coord = coord or (identity.coord if identity.rank is None else None)
    if launcher == "sar-worker" and identity.member_id is not None:
        coord = None  # the agent registered this rank already; joining again would double it

    if coord is not None:
        launch = parse_launch_env(env) if launcher is not None else None
        job = job or identity.job
        if not job:
            raise InvalidArgumentError(f"init(coord=...) needs a job name: pass job= or set {JOB_VARIABLE}.")
        if world_size is None:
            if launch is None:
                raise InvalidArgumentError(
                    f"init(coord=...) needs the world size: pass world_size= or set {WORLD_SIZE_VARIABLE}."
                )
            world_size = launch.world_size
        chosen_backend = backend or backend_setting(env) or "auto"
        result = register(
            coord,
            job=job,
            world_size=world_size,
            rank=launch.rank if launch is not None and launch.world_size == world_size else None,
            local_rank=launch.local_rank if launch is not None else 0,
            local_world_size=launch.local_world_size if launch is not None else 1,
            backend=chosen_backend,
            timeout=timeout,
            token=token,
            heartbeat_interval=None,
            environ=env,
            extra_ports_count=extra_ports,
        )
        info = _worker_info(result.assignments[0], chosen_backend)
    else:
        launch = parse_launch_env(env)
        if launch.master_addr is None or launch.master_port is None:
            given = ((MASTER_ADDR_VARIABLE, launch.master_addr), (MASTER_PORT_VARIABLE, launch.master_port))
            missing = " and ".join(name for name, value in given if value is None)
            raise InvalidArgumentError(
                f"{missing} not set (launcher: {launch.launcher}): set {MASTER_ADDR_VARIABLE} and "
                f"{MASTER_PORT_VARIABLE} to rank 0's host and a free port there, or pass coord= to let "
                "the coordinator hand them out."
            )
        if job is not None and launch.job and job != launch.job:
            raise InvalidArgumentError(
                f"job={job!r} does not match {JOB_VARIABLE}={launch.job!r} set by the launcher."
            )
        if world_size is not None and world_size != launch.world_size:
            raise InvalidArgumentError(
                f"world_size={world_size!r} does not match {WORLD_SIZE_VARIABLE}={launch.world_size} set "
                f"by the launcher ({launch.launcher})."
            )
        info = _worker_info(launch, backend or launch.backend or "auto")

    progress = progress_settings(env) if coord is None else None
    if progress is not None:
        # Under sar-worker: keep the record its agent reads, so that it reports this rank's
        # progress and notices when the rank is stopped or wedged. Started before the rendezvous,
        # which can take long, so that the agent sees the rank alive meanwhile.
        install_progress(progress.path, progress.interval, progress.agent_pid, progress.rank_label)
    if not initialize:
        start_rank_services(env)  # initialize_comms does it otherwise
    else:
        comm.initialize_comms(
            info.rank, info.world_size, info.master_addr, info.backend, master_port_number=info.master_port
        )
        info = dataclasses.replace(info, backend=comm.backend())
    log.info(
        "job=%s rank=%d generation=%d: world size %d, local rank %d of %d, master %s:%d, backend %s",
        info.job, info.rank, info.generation, info.world_size, info.local_rank, info.local_world_size,
        info.master_addr, info.master_port, info.backend,
    )  # fmt: skip
    return info
