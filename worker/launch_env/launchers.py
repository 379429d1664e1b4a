"""What a rank's environment says, as pure functions of a mapping: the launcher's variables
(``sar-worker``, torchrun, Open MPI, MPICH/PMI, Slurm) and the ``SAR_*``/``SARCOMM_*`` settings a
rank reads. Each validates its value; messages name the variable, the value and the rule.

Imports neither torch nor the coordinator client: the agent side may use it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sarcomm.common.constants import (
    AGENT_PID_VARIABLE,
    BACKENDS,
    DEFAULT_HEARTBEAT_INTERVAL,
    METRICS_HOST_VARIABLE,
    METRICS_PORT_VARIABLE,
    SOCKET_NAME_VARIABLE,
)
from sarcomm.common.errors import InvalidArgumentError, shorten

__all__ = [
    "HEARTBEAT_INTERVAL_VARIABLE",
    "LaunchEnv",
    "SlurmTask",
    "agent_pid_setting",
    "detect_launcher",
    "heartbeat_interval_setting",
    "metrics_host",
    "metrics_host_setting",
    "metrics_port_setting",
    "metrics_report_host",
    "parse_launch_env",
    "slurm_task",
    "socket_name_setting",
]

#: How often a rank stamps its progress record, and a self-registered process heartbeats (seconds).
HEARTBEAT_INTERVAL_VARIABLE = "SARCOMM_HEARTBEAT_INTERVAL"


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher's environment says, validated; see :func:`parse_launch_env`.

    ``launcher`` is one of "sar-worker", "torchrun", "env" (RANK/WORLD_SIZE set by hand),
    "openmpi", "mpich", "slurm". ``master_addr``/``master_port`` are None when MASTER_ADDR/
    MASTER_PORT are not set (MPI and Slurm do not set them); ``backend`` is None without
    SAR_BACKEND; ``coord`` is None without SAR_COORD.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    backend: str | None = None
    generation: int = 0
    job: str = ""
    restart_count: int = 0
    coord: str | None = None


# (launcher, rank, world size, local rank, local world size) variable names, in detection order.
_LAUNCHERS: tuple[tuple[str, str, str, str, str], ...] = (
    ("env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)  # fmt: skip


def detect_launcher(env: Mapping[str, str]) -> str | None:
    """Which launcher started this process, judged from ``env``; None when none did.

    RANK wins (sar-worker when SAR_JOB or SAR_MEMBER_ID is set too, torchrun when LOCAL_RANK or
    TORCHELASTIC_RUN_ID is, else "env"), then Open MPI, MPICH/PMI and Slurm, in that order: a
    launcher run inside another (torchrun inside an ``srun`` step) sets the inner variables.
    """
    if "RANK" in env:
        if "SAR_JOB" in env or "SAR_MEMBER_ID" in env:
            return "sar-worker"
        if "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env:
            return "torchrun"
        return "env"
    for launcher, rank_var, *_ in _LAUNCHERS[1:]:
        if rank_var in env:
            return launcher
    return None


def _parse_int(env: Mapping[str, str], var: str, low: int, high: int | None, rule: str) -> int:
    text = env[var]
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise InvalidArgumentError(f"{var}={shorten(text)} must be {rule}.")
    return value


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    """Tasks on this node from SLURM_TASKS_PER_NODE ("2(x3),1") and SLURM_NODEID, or None."""
    spec, node = env.get("SLURM_TASKS_PER_NODE"), env.get("SLURM_NODEID")
    if spec is None or node is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise InvalidArgumentError(
                f"SLURM_TASKS_PER_NODE={shorten(spec)} must be a list like '2(x3),1' (tasks per node)."
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    index = _parse_int(env, "SLURM_NODEID", 0, len(counts) - 1, f"an integer in 0..{len(counts) - 1}")
    return counts[index]


def _parse_local(
    env: Mapping[str, str],
    launcher: str,
    size_var: str,
    world_size: int,
    local_rank_var: str,
    local_size_var: str,
) -> tuple[int, int]:
    """Local rank and local world size; without local variables a process is alone on its host."""
    local_size: int | None = None
    size_source = local_size_var
    if local_size_var in env:
        local_size = _parse_int(
            env, local_size_var, 1, world_size, f"an integer in 1..{size_var} ({size_var}={world_size})"
        )
    elif launcher == "slurm":
        local_size = _slurm_local_size(env)
        size_source = "SLURM_TASKS_PER_NODE"
    if local_rank_var not in env:
        if local_size not in (None, 1):
            raise InvalidArgumentError(
                f"{local_rank_var} is not set although {size_source} says this host runs {local_size} "
                "ranks; set both."
            )
        return 0, 1
    if local_size is None:
        raise InvalidArgumentError(
            f"{local_size_var} is not set although {local_rank_var} is; set both "
            "(torchrun and sar-worker do)."
        )
    local_rank = _parse_int(
        env, local_rank_var, 0, local_size - 1,
        f"an integer in 0..{local_size_var}-1 ({local_size_var}={local_size})",
    )  # fmt: skip
    return local_rank, local_size


def parse_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """Rank, world size, local rank and size, master and ``SAR_*`` settings from ``env``.

    Pure: reads only ``env``. Rules: the world size is an integer >= 1, the rank one in
    0..world_size-1, the local world size one in 1..world_size, the local rank one in
    0..local_world_size-1 (without local variables, a process counts as alone on its host: 0 of
    1); MASTER_PORT is an integer in 1..65535, MASTER_ADDR is not empty; SAR_GENERATION and
    SAR_RESTART_COUNT are integers >= 0; SAR_BACKEND is one of :data:`BACKENDS`.

    Raises:
        InvalidArgumentError: no launcher's variables are set, one is missing, or a value breaks
            its rule; the message names the variable, its value and the rule, e.g.
            ``RANK='x' must be an integer in 0..WORLD_SIZE-1 (WORLD_SIZE=4).``
    """
    launcher = detect_launcher(env)
    if launcher is None:
        raise InvalidArgumentError(
            "No launcher variables are set: RANK and WORLD_SIZE (sar-worker, torchrun), "
            "OMPI_COMM_WORLD_RANK (Open MPI), PMI_RANK (MPICH) or SLURM_PROCID (Slurm). Start the "
            "process with one of them, or register it with a coordinator: init(coord=..., job=..., "
            "world_size=...)."
        )
    names = next(
        n for n in _LAUNCHERS if n[0] == ("env" if launcher in ("sar-worker", "torchrun") else launcher)
    )
    _, rank_var, size_var, local_rank_var, local_size_var = names
    if size_var not in env:
        raise InvalidArgumentError(f"{size_var} is not set although {rank_var} is; a launcher sets both.")
    world_size = _parse_int(env, size_var, 1, None, "an integer >= 1")
    rank = _parse_int(
        env, rank_var, 0, world_size - 1, f"an integer in 0..{size_var}-1 ({size_var}={world_size})"
    )
    local_rank, local_size = _parse_local(env, launcher, size_var, world_size, local_rank_var, local_size_var)
    master_addr = env.get("MASTER_ADDR")
    if master_addr is not None and not master_addr.strip():
        raise InvalidArgumentError("MASTER_ADDR='' must be the host name or address of rank 0.")
    master_port = (
        _parse_int(env, "MASTER_PORT", 1, 65535, "an integer in 1..65535 (a TCP port)")
        if "MASTER_PORT" in env
        else None
    )
    backend = env.get("SAR_BACKEND")
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgumentError(f"SAR_BACKEND={shorten(backend)} must be one of {', '.join(BACKENDS)}.")
    generation = (
        _parse_int(env, "SAR_GENERATION", 0, None, "an integer >= 0") if "SAR_GENERATION" in env else 0
    )
    restarts = (
        _parse_int(env, "SAR_RESTART_COUNT", 0, None, "an integer >= 0") if "SAR_RESTART_COUNT" in env else 0
    )
    return LaunchEnv(
        launcher=launcher,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_size,
        master_addr=master_addr.strip() if master_addr is not None else None,
        master_port=master_port,
        backend=backend,
        generation=generation,
        job=env.get("SAR_JOB", ""),
        restart_count=restarts,
        coord=env.get("SAR_COORD") or None,
    )


# -- settings a rank reads -------------------------------------------------------------------------


def socket_name_setting(environ: Mapping[str, str]) -> str:
    """``SAR_SOCKET_NAME`` without surrounding blanks; "" when it is unset or empty (then the
    coordinator chooses the interface, and the backends keep their own defaults until it has)."""
    return environ.get(SOCKET_NAME_VARIABLE, "").strip()


def heartbeat_interval_setting(env: Mapping[str, str], value: float | None) -> float:
    """Seconds between heartbeats and progress stamps: ``value`` when given, else
    ``SARCOMM_HEARTBEAT_INTERVAL``, else the coordinator's default (1 s).

    Raises:
        InvalidArgumentError: the one in force is not a positive number of seconds.
    """
    if value is None:
        text = env.get(HEARTBEAT_INTERVAL_VARIABLE)
        if text is None:
            return DEFAULT_HEARTBEAT_INTERVAL
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0:
            raise InvalidArgumentError(
                f"{HEARTBEAT_INTERVAL_VARIABLE}={shorten(text)} must be a positive number of seconds."
            )
    if not value > 0:
        raise InvalidArgumentError(f"heartbeat_interval={value!r} must be a positive number of seconds.")
    return value


def agent_pid_setting(env: Mapping[str, str]) -> int | None:
    """``SAR_AGENT_PID`` as a pid, or None (unset, or not a positive integer: then not watched)."""
    text = env.get(AGENT_PID_VARIABLE, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def metrics_port_setting(environ: Mapping[str, str], member: bool) -> int | None:
    """The port this rank serves ``/metrics`` on (0: any free port), or None for no endpoint.

    ``SAR_METRICS_PORT`` decides when set (``sar-worker`` always sets it): a port, 0 or -1 (none).
    Unset, a process that is a member at a coordinator (``member``) serves on any free port, so
    that ``/sd`` lists it; any other process serves none (a plain torchrun job opts in with the
    variable). Raises :class:`InvalidArgumentError` for a value that is not an integer in -1..65535.
    """
    raw = environ.get(METRICS_PORT_VARIABLE, "").strip()
    if not raw:
        return 0 if member else None
    try:
        port = int(raw)
    except ValueError:
        port = -2
    if not -1 <= port <= 65535:
        raise InvalidArgumentError(
            f"{METRICS_PORT_VARIABLE}={shorten(raw)} must be an integer in -1..65535 "
            "(0: any free port, -1: no metrics endpoint)."
        )
    return None if port == -1 else port


#: Where a rank's ``/metrics`` endpoint listens unless told: every IPv4 interface.
ALL_INTERFACES: Final = "0.0.0.0"


def metrics_host(text: str, source: str) -> str:
    """``text`` (the value of ``source``, a flag or variable) as the address to serve ``/metrics``
    on: an IP address, written as Python's ``ipaddress`` writes it; "" means every interface.

    Only an IP address: the coordinator lists a rank's endpoint in ``/sd`` only on an address of
    the rank's own host (or the wildcard), and a host name would have to be resolved first.
    Raises :class:`InvalidArgumentError` naming ``source`` otherwise.
    """
    text = text.strip()
    if not text:
        return ""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise InvalidArgumentError(
            f"{source}={shorten(text)} must be an IP address of this host to serve /metrics on "
            f"(e.g. 127.0.0.1; {ALL_INTERFACES} or unset: every interface)."
        ) from None


def metrics_host_setting(environ: Mapping[str, str]) -> str:
    """The address this rank serves ``/metrics`` on: ``SAR_METRICS_HOST`` (``sar-worker
    --metrics-host`` sets it), else every interface (``0.0.0.0``). Raises
    :class:`InvalidArgumentError` for a value that is not an IP address."""
    return metrics_host(environ.get(METRICS_HOST_VARIABLE, ""), METRICS_HOST_VARIABLE) or ALL_INTERFACES


def metrics_report_host(bind_host: str, member_address: str) -> str:
    """The address to report to the coordinator for an endpoint bound on ``bind_host``: the
    member's own address when it listens on every interface ("" or a wildcard, reachable there),
    else ``bind_host`` itself, where it really listens (an address of the member's host, which the
    coordinator accepts and lists in ``/sd``)."""
    if not bind_host or ipaddress.ip_address(bind_host).is_unspecified:
        return member_address
    return bind_host


@dataclass(frozen=True)
class SlurmTask:
    """The ``srun`` task this process is: what ``sar-worker`` takes from Slurm when no flag says.

    ``job`` is ``SLURM_JOB_NAME-SLURM_JOB_ID`` made a valid job name (unique per allocation, so two
    allocations of one script never share a world); ``tasks`` the step's task count, ``procid``
    this task's index among them, ``localid`` its index on this node, ``node_tasks`` the step's
    tasks on this node.
    """

    job: str
    tasks: int
    procid: int
    localid: int
    node_tasks: int


def _slurm_job_name(env: Mapping[str, str]) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", env.get("SLURM_JOB_NAME", "")).strip("-._") or "slurm"
    job_id = re.sub(r"[^A-Za-z0-9._-]+", "-", env.get("SLURM_JOB_ID", "")).strip("-._")
    full = f"{name}-{job_id}" if job_id else name
    return full[-128:].lstrip("-._") or "slurm"


def slurm_task(env: Mapping[str, str]) -> SlurmTask | None:
    """The task of the ``srun`` step that runs this process, or None outside one (no
    ``SLURM_STEP_ID`` or ``SLURM_PROCID``: a batch script's own shell is no task of a step).

    Raises:
        InvalidArgumentError: a Slurm variable has a value its rule forbids (the message names it).
    """
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    tasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if tasks_var not in env:
        raise InvalidArgumentError(
            "SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is: run sar-worker "
            "with srun, or give --world-size."
        )
    tasks = _parse_int(env, tasks_var, 1, None, "an integer >= 1")
    procid = _parse_int(
        env, "SLURM_PROCID", 0, tasks - 1, f"an integer in 0..{tasks - 1} ({tasks_var}={tasks})"
    )
    per_node = {**env}
    if "SLURM_STEP_TASKS_PER_NODE" in env:
        per_node["SLURM_TASKS_PER_NODE"] = env["SLURM_STEP_TASKS_PER_NODE"]
    node_tasks = _slurm_local_size(per_node) or 1
    localid = (
        _parse_int(env, "SLURM_LOCALID", 0, node_tasks - 1, f"an integer in 0..{node_tasks - 1}")
        if "SLURM_LOCALID" in env
        else 0
    )
    return SlurmTask(_slurm_job_name(env), tasks, procid, localid, node_tasks)
