"""The settings of a ``sar-worker`` agent and the environment it gives each local rank.

Pure: :class:`AgentConfig` validates the flags when built; :func:`rank_environment` computes a
rank's variables from the join's answer. Neither touches processes, the network or torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sarcomm.common import durations
from sarcomm.common.addresses import parse_targets
from sarcomm.common.constants import (
    AGENT_PID_VARIABLE,
    AUTO_METRICS_VARIABLE,
    BACKENDS,
    DEFAULT_LAST_CALL_TIMEOUT,
    HEARTBEAT_INTERVAL_VARIABLE,
    INTERFACE_VARIABLES,
    MAX_LAST_CALL_TIMEOUT,
    MAX_RESTARTS,
    MAX_WORLD_SIZE,
    METRICS_HOST_VARIABLE,
    METRICS_PORT_VARIABLE,
    OMP_THREADS_VARIABLE,
    PROGRESS_FILE_VARIABLE,
)
from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.common.messages import JoinResult
from sarcomm.common.ports import check_extra_ports
from sarcomm.common.tls import ClientTls
from sarcomm.worker.agent.output import DEFAULT_OUTPUT_TAG, Tee, check_output_tag
from sarcomm.worker.launch_env import member_environment, metrics_host, rank_metrics_port

__all__ = [
    "METRICS_ANY_PORT",
    "METRICS_OFF",
    "STOP_GRACE_S",
    "AgentConfig",
    "WorldSize",
    "omp_threads",
    "rank_environment",
    "rank_metrics_port",
]

#: Seconds a rank gets between SIGTERM and SIGKILL when the agent stops it.
STOP_GRACE_S = 10.0

#: ``--metrics-port`` values with a meaning of their own.
METRICS_ANY_PORT = 0
METRICS_OFF = -1


@dataclass(frozen=True)
class WorldSize:
    """``--world-size``: ``N`` ranks (``low == high``, fixed), or ``MIN:MAX`` (``elastic``: the
    world forms with MIN to MAX ranks and re-forms when agents come or go)."""

    #: The flag's rule: counts of ranks the protocol carries.
    RULE = f"an integer in 1..{MAX_WORLD_SIZE}"

    low: int
    high: int
    elastic: bool = False

    @classmethod
    def parse(cls, text: str) -> WorldSize:
        """``N`` or ``MIN:MAX``.

        Raises:
            ValueError: ``N`` breaks :attr:`RULE` (the flag's rule says so).
            InvalidArgumentError: a range that breaks its rule (the message says which).
        """
        if ":" not in text:
            value = int(text.strip())
            if not 1 <= value <= MAX_WORLD_SIZE:
                raise ValueError
            return cls(value, value)
        low_text, _, high_text = text.partition(":")
        try:
            low, high = int(low_text.strip()), int(high_text.strip())
        except ValueError:
            low = high = 0
        if not (1 <= low <= MAX_WORLD_SIZE and 1 <= high <= MAX_WORLD_SIZE):
            raise InvalidArgumentError(
                f"MIN and MAX of an elastic world must be integers in 1..{MAX_WORLD_SIZE} (MIN:MAX ranks, "
                "e.g. 2:4)."
            )
        if low > high:
            raise InvalidArgumentError(
                f"MIN {low} must be at most MAX {high}: an elastic world has MIN to MAX ranks "
                f"(e.g. {high}:{low})."
            )
        return cls(low, high, elastic=True)


@dataclass(frozen=True)
class AgentConfig:
    """Settings of one agent, validated when built (messages name the flag, value and rule).

    Attributes:
        coord: coordinator address ``HOST:PORT``, or its replicas' separated by commas (the
            ranks get it whole in ``SAR_COORD``).
        job: job name.
        world_size: ranks in the whole job (>= 1); in an elastic job (``min_world_size`` set) the
            most, MAX of ``--world-size MIN:MAX``.
        min_world_size: None for a fixed world (the default); else the fewest ranks an elastic
            world forms with (MIN of ``--world-size MIN:MAX``). Ranks are counted, and each agent
            brings its ``nproc_per_node``, so MIN and MAX are multiples of it.
        last_call_timeout: in an elastic job, seconds without a new arrival after which a world
            of MIN or more ranks forms (default :data:`DEFAULT_LAST_CALL_TIMEOUT`, torchrun's
            plugin's).
        command: the program and arguments each local rank runs (empty only for subcommands).
        rank: global rank of local rank 0 (its ranks are ``rank..rank+nproc_per_node-1``);
            None lets the coordinator deal them (contiguous per host).
        nproc_per_node: local ranks this agent runs (1..world_size).
        backend: torch.distributed backend the ranks use (one of ``BACKENDS``).
        socket_name: interface to force ("" lets the coordinator choose).
        max_restarts: how often to join again and restart after a failure (default 0).
        metrics_port: where the ranks serve /metrics: P > 0 gives local rank i port P+i, 0 (the
            default) any free port, -1 no endpoint. The agent reports each bound port to the
            coordinator, which lists it in ``/sd``.
        metrics_host: the IP address the ranks serve /metrics on ("", the default: every
            interface); given to them as ``SAR_METRICS_HOST``.
        join_timeout: seconds to wait for the world to form (None: the coordinator's default).
        heartbeat_interval: seconds between heartbeats (default 1; keep it at or below the
            coordinator's ``--heartbeat-interval``).
        stop_grace: seconds between SIGTERM and SIGKILL when stopping ranks (default
            :data:`STOP_GRACE_S`).
        token: bearer token for the coordinator, or None.
        tls: TLS settings for the coordinator connection (``--tls-ca``, ``--tls-cert``,
            ``--tls-key``), or None for plaintext.
        local_rank: the node-local rank of this agent's first rank (0; under Slurm, one agent per
            task: its ``SLURM_LOCALID``).
        local_world_size: ranks on this node, of all its agents (None: ``nproc_per_node``).
        output_tag: what each console line of a rank starts with (``{rank}``, ``{local_rank}``
            filled in; "" for none); see :mod:`sarcomm.worker.agent.output`.
        log_dir: folder for each rank's output files (None: no files).
        tee: where the ranks' output goes: the console, the files or both.
        extra_ports: ports after the master port reserved with it for SAR's sampling workers
            (0..MAX_EXTRA_PORTS, default 0), handed to the ranks as ``SAR_EXTRA_PORTS``.
        auto_metrics: the ranks' zero-code metrics (:mod:`sarcomm.worker.autometrics`); False
            (``--no-auto-metrics``) gives them ``SAR_AUTO_METRICS=0``.
    """

    coord: str
    job: str
    world_size: int
    command: tuple[str, ...] = ()
    rank: int | None = None
    nproc_per_node: int = 1
    backend: str = "auto"
    socket_name: str = ""
    max_restarts: int = 0
    metrics_port: int = 0
    metrics_host: str = ""
    join_timeout: float | None = None
    heartbeat_interval: float = 1.0
    stop_grace: float = STOP_GRACE_S
    token: str | None = field(default=None, repr=False)
    tls: ClientTls | None = None
    local_rank: int = 0
    local_world_size: int | None = None
    output_tag: str = DEFAULT_OUTPUT_TAG
    log_dir: Path | None = None
    tee: Tee = Tee.CONSOLE
    extra_ports: int = 0
    auto_metrics: bool = True
    min_world_size: int | None = None
    last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT

    def __post_init__(self) -> None:
        # One form of a list (no spaces around its items): the ranks get it in SAR_COORD.
        object.__setattr__(self, "coord", ",".join(parse_targets(self.coord)))
        if not self.job:
            raise InvalidArgumentError(
                "--job '' must name the job (1 to 128 letters, digits, '.', '_', '-')."
            )
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise InvalidArgumentError(f"--world-size {self.world_size} must be {WorldSize.RULE}.")
        if not 1 <= self.nproc_per_node <= self.world_size:
            raise InvalidArgumentError(
                f"--nproc-per-node {self.nproc_per_node} must be in 1..--world-size ({self.world_size})."
            )
        if self.min_world_size is not None:
            self._check_elastic(self.min_world_size)
        if self.rank is not None and not 0 <= self.rank <= self.world_size - self.nproc_per_node:
            raise InvalidArgumentError(
                f"--rank {self.rank} must be in 0..{self.world_size - self.nproc_per_node}: the ranks "
                f"{self.rank}..{self.rank + self.nproc_per_node - 1} of this host's {self.nproc_per_node} "
                f"local ranks must fit in --world-size {self.world_size}."
            )
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(
                f"--backend {shorten(self.backend)} must be one of {', '.join(BACKENDS)}."
            )
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise InvalidArgumentError(
                f"--max-restarts {self.max_restarts} must be an integer in 0..{MAX_RESTARTS}."
            )
        if self.metrics_port not in (METRICS_ANY_PORT, METRICS_OFF) and not (
            1 <= self.metrics_port <= 65536 - self.nproc_per_node
        ):
            raise InvalidArgumentError(
                f"--metrics-port {self.metrics_port} must be -1 (no metrics), 0 (any free port) or in "
                f"1..{65536 - self.nproc_per_node}, so that port + local rank stays a TCP port."
            )
        if metrics_host(self.metrics_host, "--metrics-host") != self.metrics_host:
            raise InvalidArgumentError(
                f"--metrics-host {shorten(self.metrics_host)} must be an IP address written as "
                f"{metrics_host(self.metrics_host, '--metrics-host')!r} (or '' for every interface)."
            )
        for flag, value in (
            ("--join-timeout", self.join_timeout),
            ("--heartbeat-interval", self.heartbeat_interval),
        ):
            try:
                if value is not None:
                    durations.duration(value)
            except ValueError:
                raise InvalidArgumentError(f"{flag} {value} must be {durations.rule()}.") from None
        check_extra_ports(self.extra_ports, "--extra-ports")
        if not self.stop_grace >= 0:
            raise InvalidArgumentError(f"stop_grace {self.stop_grace} must be a number of seconds >= 0.")
        node_ranks = self.node_ranks
        if not 0 <= self.local_rank <= node_ranks - self.nproc_per_node:
            raise InvalidArgumentError(
                f"local rank {self.local_rank} must be in 0..{node_ranks - self.nproc_per_node}: this "
                f"agent's {self.nproc_per_node} local rank(s) must fit in the node's {node_ranks}."
            )
        check_output_tag(self.output_tag)
        if self.tee.files and self.log_dir is None:
            raise InvalidArgumentError(
                f"--tee {self.tee.value} writes the ranks' output to files: give --log-dir DIR too."
            )

    def _check_elastic(self, low: int) -> None:
        """An elastic range must be one whole agents fill: each brings ``nproc_per_node`` ranks."""
        world, k = f"{low}:{self.world_size}", self.nproc_per_node
        if not 1 <= low <= self.world_size:
            raise InvalidArgumentError(f"--world-size {world}: MIN must be in 1..MAX ({self.world_size}).")
        if low % k or self.world_size % k:
            fit_low = -(-low // k) * k
            fit_high = max(fit_low, self.world_size // k * k)
            raise InvalidArgumentError(
                f"--world-size {world} with --nproc-per-node {k}: MIN and MAX count ranks and each agent "
                f"brings its {k}, so both must be multiples of {k} (e.g. --world-size {fit_low}:{fit_high})."
            )
        if self.rank is not None:
            raise InvalidArgumentError(
                f"--rank {self.rank} cannot be used with --world-size {world}: the coordinator deals the "
                "ranks of an elastic world; leave --rank out."
            )
        if not (
            math.isfinite(self.last_call_timeout) and 0 <= self.last_call_timeout <= MAX_LAST_CALL_TIMEOUT
        ):
            raise InvalidArgumentError(
                f"--last-call-timeout {self.last_call_timeout:g} must be a number of seconds in "
                f"0..{MAX_LAST_CALL_TIMEOUT:g}."
            )

    @property
    def elastic(self) -> bool:
        """Whether the world is elastic (``--world-size MIN:MAX``)."""
        return self.min_world_size is not None

    @property
    def world_text(self) -> str:
        """``--world-size`` as the user gave it: ``N`` or ``MIN:MAX``."""
        return f"{self.min_world_size}:{self.world_size}" if self.elastic else str(self.world_size)

    @property
    def node_ranks(self) -> int:
        """Ranks on this node, of all its agents."""
        return self.nproc_per_node if self.local_world_size is None else self.local_world_size

    @property
    def local_ranks(self) -> list[int]:
        """Node-local ranks of this agent's ranks."""
        return list(range(self.local_rank, self.local_rank + self.nproc_per_node))

    @property
    def ranks(self) -> list[int] | None:
        """Requested global ranks of the local ranks, or None."""
        return None if self.rank is None else list(range(self.rank, self.rank + self.nproc_per_node))


def omp_threads(local_ranks: int) -> int:
    """Intra-op threads per rank when the user set no ``OMP_NUM_THREADS``: this host's usable CPUs
    shared among its local ranks (at least 1).

    Without it every rank starts one OpenMP thread per CPU, and ranks that share a host
    oversubscribe it: OpenMP's spin-waiting then stalls the copies around collectives for tens of
    milliseconds (measured with 4 ranks on 2 cores: a 1 MiB all_to_all took 55 to 120 ms instead
    of 2 ms). torchrun guards against the same by setting 1.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_ranks))


def rank_environment(
    base: Mapping[str, str],
    config: AgentConfig,
    joined: JoinResult,
    index: int,
    restart_count: int,
    progress_file: Path | None = None,
) -> dict[str, str]:
    """The environment of local rank ``index``: ``base`` plus the contract's variables
    (:func:`~sarcomm.worker.launch_env.member_environment`, as a process that registers itself
    exports them; ``SAR_BACKEND`` always).

    Besides the contract's variables: ``SAR_MEMBER_ID``/``SAR_MEMBER_SECRET`` (the rank's identity
    at the coordinator), ``SAR_RESTART_COUNT``, ``SAR_METRICS_PORT`` (see :func:`rank_metrics_port`),
    ``SAR_METRICS_HOST`` (with ``--metrics-host``),
    ``SARCOMM_HEARTBEAT_INTERVAL`` (how often the rank's library stamps its progress record),
    ``SAR_AGENT_PID`` (the agent: a rank whose agent is gone stops, see
    :data:`~sarcomm.common.constants.AGENT_PID_VARIABLE`), ``OMP_NUM_THREADS`` unless set (see
    :func:`omp_threads`), with ``--extra-ports K`` ``SAR_EXTRA_PORTS`` (the K ports after the master
    port, reserved on the master's host) and, when given, ``SAR_PROGRESS_FILE`` (where it keeps
    that record for the agent to read).
    """
    member = joined.assignments[index]
    env = dict(base)
    env.update(
        member_environment(joined, index, config.coord, restart_count, config.backend, config.extra_ports)
    )
    env.update(
        {
            METRICS_PORT_VARIABLE: str(rank_metrics_port(config.metrics_port, member.local_rank)),
            HEARTBEAT_INTERVAL_VARIABLE: str(config.heartbeat_interval),
            AGENT_PID_VARIABLE: str(os.getpid()),
        }
    )
    if not env.get(OMP_THREADS_VARIABLE):
        env[OMP_THREADS_VARIABLE] = str(omp_threads(config.node_ranks))
    if progress_file is not None:
        env[PROGRESS_FILE_VARIABLE] = str(progress_file)
    if config.metrics_host:
        env[METRICS_HOST_VARIABLE] = config.metrics_host
    if not config.auto_metrics:
        env[AUTO_METRICS_VARIABLE] = "0"
    env.update({name: joined.interface for name in INTERFACE_VARIABLES})
    return env
