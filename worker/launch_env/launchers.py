"""Who started this process, and as which rank: the launchers' variables (``sar-worker``,
torchrun, Open MPI, MPICH/PMI, Slurm) as pure functions of a mapping. Each validates its value;
messages name the variable, the value and the rule.

The launchers' own variables (``OMPI_*``, ``PMI_*``, ``SLURM_*``, ``TORCHELASTIC_RUN_ID``) are
named here, where they are parsed and nowhere else; the contract's are in
:mod:`sarcomm.common.constants`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sarcomm.common.constants import (
    BACKEND_VARIABLE,
    BACKENDS,
    COORD_VARIABLE,
    GENERATION_VARIABLE,
    JOB_VARIABLE,
    LOCAL_RANK_VARIABLE,
    LOCAL_WORLD_SIZE_VARIABLE,
    MASTER_ADDR_VARIABLE,
    MASTER_PORT_VARIABLE,
    MAX_WORLD_SIZE,
    MEMBER_ID_VARIABLE,
    RANK_VARIABLE,
    RESTART_COUNT_VARIABLE,
    WORLD_SIZE_VARIABLE,
)
from sarcomm.common.errors import InvalidArgumentError, shorten

__all__ = [
    "LaunchEnv",
    "SlurmTask",
    "check_backend",
    "detect_launcher",
    "parse_int",
    "parse_launch_env",
    "slurm_task",
]


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
    ("env", RANK_VARIABLE, WORLD_SIZE_VARIABLE, LOCAL_RANK_VARIABLE, LOCAL_WORLD_SIZE_VARIABLE),
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
    if RANK_VARIABLE in env:
        if JOB_VARIABLE in env or MEMBER_ID_VARIABLE in env:
            return "sar-worker"
        if "TORCHELASTIC_RUN_ID" in env or LOCAL_RANK_VARIABLE in env:
            return "torchrun"
        return "env"
    for launcher, rank_var, *_ in _LAUNCHERS[1:]:
        if rank_var in env:
            return launcher
    return None


def parse_int(env: Mapping[str, str], var: str, low: int, high: int | None, rule: str) -> int:
    """``env[var]`` as an integer in ``low..high`` (``high`` None: no upper bound); else raises
    :class:`InvalidArgumentError` ``VAR='text' must be RULE.``"""
    text = env[var]
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise InvalidArgumentError(f"{var}={shorten(text)} must be {rule}.")
    return value


def _slurm_local_size(env: Mapping[str, str], var: str = "SLURM_TASKS_PER_NODE") -> int | None:
    """Tasks on this node from ``var`` (Slurm's "2(x3),1": tasks per node) and SLURM_NODEID, or
    None when either is unset. Messages name ``var``."""
    spec, node = env.get(var), env.get("SLURM_NODEID")
    if spec is None or node is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise InvalidArgumentError(
                f"{var}={shorten(spec)} must be a list like '2(x3),1' (tasks per node)."
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    index = parse_int(
        env, "SLURM_NODEID", 0, len(counts) - 1,
        f"an integer in 0..{len(counts) - 1} ({var} lists {len(counts)} node(s))",
    )  # fmt: skip
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
        local_size = parse_int(
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
    local_rank = parse_int(
        env, local_rank_var, 0, local_size - 1,
        f"an integer in 0..{local_size_var}-1 ({local_size_var}={local_size})",
    )  # fmt: skip
    return local_rank, local_size


def parse_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """Rank, world size, local rank and size, master and ``SAR_*`` settings from ``env``.

    Pure: reads only ``env``. Rules: the world size is an integer in 1..2**31-1, the rank one in
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
    world_size = parse_int(env, size_var, 1, MAX_WORLD_SIZE, f"an integer in 1..{MAX_WORLD_SIZE}")
    rank = parse_int(
        env, rank_var, 0, world_size - 1, f"an integer in 0..{size_var}-1 ({size_var}={world_size})"
    )
    local_rank, local_size = _parse_local(env, launcher, size_var, world_size, local_rank_var, local_size_var)
    master_addr = env.get(MASTER_ADDR_VARIABLE)
    if master_addr is not None and not master_addr.strip():
        raise InvalidArgumentError(f"{MASTER_ADDR_VARIABLE}='' must be the host name or address of rank 0.")
    master_port = (
        parse_int(env, MASTER_PORT_VARIABLE, 1, 65535, "an integer in 1..65535 (a TCP port)")
        if MASTER_PORT_VARIABLE in env
        else None
    )
    backend = env.get(BACKEND_VARIABLE)
    if backend is not None:
        check_backend(backend)
    generation = (
        parse_int(env, GENERATION_VARIABLE, 0, None, "an integer >= 0") if GENERATION_VARIABLE in env else 0
    )
    restarts = (
        parse_int(env, RESTART_COUNT_VARIABLE, 0, None, "an integer >= 0")
        if RESTART_COUNT_VARIABLE in env
        else 0
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
        job=env.get(JOB_VARIABLE, ""),
        restart_count=restarts,
        coord=env.get(COORD_VARIABLE) or None,
    )


def check_backend(text: str) -> str:
    """``text``, the value of ``SAR_BACKEND``, when it is one of :data:`BACKENDS`; else raises
    :class:`InvalidArgumentError` ``SAR_BACKEND='x' must be one of auto, gloo, ...``."""
    if text not in BACKENDS:
        raise InvalidArgumentError(
            f"{BACKEND_VARIABLE}={shorten(text)} must be one of {', '.join(BACKENDS)}."
        )
    return text


@dataclass(frozen=True)
class SlurmTask:
    """The ``srun`` task this process is: what ``sar-worker`` takes from Slurm when no flag says.

    Each property reads and checks only its own variables, when asked: a value that a flag or
    ``SARCOMM_*`` variable replaces is never asked for, so a Slurm variable it replaces is never
    parsed (flags win, whatever Slurm's variables hold).

    ``job`` is ``SLURM_JOB_NAME-SLURM_JOB_ID`` made a valid job name (unique per allocation, so two
    allocations of one script never share a world); ``tasks`` the step's task count, ``procid``
    this task's index among them, ``localid`` its index on this node, ``node_tasks`` the step's
    tasks on this node. Each raises :class:`InvalidArgumentError` naming the variable at fault.
    """

    env: Mapping[str, str]

    @property
    def job(self) -> str:
        env = self.env
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", env.get("SLURM_JOB_NAME", "")).strip("-._") or "slurm"
        job_id = re.sub(r"[^A-Za-z0-9._-]+", "-", env.get("SLURM_JOB_ID", "")).strip("-._")
        full = f"{name}-{job_id}" if job_id else name
        return full[-128:].lstrip("-._") or "slurm"

    @property
    def tasks_variable(self) -> str:
        """The variable that says the step's task count (the step's own, or the job's)."""
        var = next((v for v in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if v in self.env), None)
        if var is None:
            raise InvalidArgumentError(
                "SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is: run sar-worker "
                "with srun, or give --world-size."
            )
        return var

    @property
    def tasks(self) -> int:
        rule = f"an integer in 1..{MAX_WORLD_SIZE}"
        return parse_int(self.env, self.tasks_variable, 1, MAX_WORLD_SIZE, rule)

    @property
    def procid(self) -> int:
        tasks, var = self.tasks, self.tasks_variable
        return parse_int(
            self.env, "SLURM_PROCID", 0, tasks - 1, f"an integer in 0..{tasks - 1} ({var}={tasks})"
        )

    @property
    def _node_tasks_variable(self) -> str:
        step = "SLURM_STEP_TASKS_PER_NODE"
        return step if step in self.env else "SLURM_TASKS_PER_NODE"

    @property
    def node_tasks(self) -> int:
        return _slurm_local_size(self.env, self._node_tasks_variable) or 1

    @property
    def localid(self) -> int:
        if "SLURM_LOCALID" not in self.env:
            return 0
        node_tasks = self.node_tasks
        rule = f"an integer in 0..{node_tasks - 1} (this node runs {node_tasks} task(s) of the step)"
        return parse_int(self.env, "SLURM_LOCALID", 0, node_tasks - 1, rule)


def slurm_task(env: Mapping[str, str]) -> SlurmTask | None:
    """The task of the ``srun`` step that runs this process, or None outside one (no
    ``SLURM_STEP_ID`` or ``SLURM_PROCID``: a batch script's own shell is no task of a step).
    Reads nothing else: :class:`SlurmTask`'s properties check the variables they read.
    """
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    return SlurmTask(dict(env))
