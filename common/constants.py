"""Names and values both sides agree on, each defined once: backends, the environment a rank is
given, the interface variables of the backends, event kinds and failure reasons.

Every variable a rank is given, or a rank's library reads, is named here (the ``*_VARIABLE`` names;
the launchers' own, ``OMPI_*``, ``PMI_*``, ``SLURM_*``, where they are parsed, in
:mod:`sarcomm.worker.launch_env.launchers`). :mod:`sarcomm.worker.launch_env` is the one place that
reads them; ``tests/test_env_reads.py`` holds both rules."""

from __future__ import annotations

import enum
import re
from typing import Final

__all__ = [
    "AGENT_PID_VARIABLE",
    "AUTO_METRICS_PID_VARIABLE",
    "AUTO_METRICS_VARIABLE",
    "BACKENDS",
    "BACKEND_VARIABLE",
    "COLLECTIVE_TIMEOUT_VARIABLE",
    "COORD_VARIABLE",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_HEARTBEAT_MISSES",
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_LAST_CALL_TIMEOUT",
    "ENDPOINTS_DIR_VARIABLE",
    "EXIT_TIMEOUT_VARIABLE",
    "EXTRA_PORTS_VARIABLE",
    "GENERATION_VARIABLE",
    "GLOO_INTERFACE_VARIABLE",
    "GROUP_RANK_VARIABLE",
    "HEARTBEAT_INTERVAL_VARIABLE",
    "INTERFACE_VARIABLES",
    "JOB_NAME",
    "JOB_NAME_RULE",
    "JOB_VARIABLE",
    "JOIN_ANSWER_SLACK_S",
    "LOCAL_RANK_VARIABLE",
    "LOCAL_WORLD_SIZE_VARIABLE",
    "MASTER_ADDR_VARIABLE",
    "MASTER_PORT_VARIABLE",
    "MAX_EXTRA_PORTS",
    "MAX_LAST_CALL_TIMEOUT",
    "MAX_RESTARTS",
    "MAX_WORLD_SIZE",
    "MEMBER_ID_VARIABLE",
    "MEMBER_SECRET_VARIABLE",
    "METRICS_HOST_VARIABLE",
    "METRICS_PORT_VARIABLE",
    "OMP_THREADS_VARIABLE",
    "PROGRESS_FILE_VARIABLE",
    "RANK_VARIABLE",
    "RESTART_COUNT_VARIABLE",
    "SOCKET_NAME_VARIABLE",
    "TLS_CA_VARIABLE",
    "TLS_CERT_VARIABLE",
    "TLS_KEY_VARIABLE",
    "TOKEN_FILE_VARIABLE",
    "TORCH_AUTOLOAD_VARIABLE",
    "TORCH_NCCL_TIMING_VARIABLE",
    "WORLD_SIZE_VARIABLE",
    "EventKind",
    "FailureReason",
    "is_job_name",
]

#: torch.distributed backends a job may name; "auto" lets ``initialize_comms`` choose (nccl when
#: CUDA is there, else gloo). The wire also accepts "" for "not said".
BACKENDS: Final = ("auto", "gloo", "nccl", "ccl", "mpi", "ucc")

#: Who a rank is and where its world meets (the contract's variables, as torchrun names the first
#: six): ``sar-worker`` gives them to each rank, a process that registers itself exports them.
RANK_VARIABLE: Final = "RANK"
WORLD_SIZE_VARIABLE: Final = "WORLD_SIZE"
LOCAL_RANK_VARIABLE: Final = "LOCAL_RANK"
LOCAL_WORLD_SIZE_VARIABLE: Final = "LOCAL_WORLD_SIZE"
MASTER_ADDR_VARIABLE: Final = "MASTER_ADDR"
MASTER_PORT_VARIABLE: Final = "MASTER_PORT"
#: torchrun's node rank of a worker's agent (its workers' ``GROUP_RANK``).
GROUP_RANK_VARIABLE: Final = "GROUP_RANK"
#: The coordinator's address (a comma-separated list of replicas), the job, the world's generation
#: and the backend asked for ("auto" lets ``initialize_comms`` choose).
COORD_VARIABLE: Final = "SAR_COORD"
JOB_VARIABLE: Final = "SAR_JOB"
GENERATION_VARIABLE: Final = "SAR_GENERATION"
BACKEND_VARIABLE: Final = "SAR_BACKEND"
#: The rank's identity at the coordinator, and how often its agent restarted the world.
MEMBER_ID_VARIABLE: Final = "SAR_MEMBER_ID"
MEMBER_SECRET_VARIABLE: Final = "SAR_MEMBER_SECRET"
RESTART_COUNT_VARIABLE: Final = "SAR_RESTART_COUNT"
#: Seconds a collective may block (the process group's timeout), and the exit hook may take.
COLLECTIVE_TIMEOUT_VARIABLE: Final = "SAR_COLLECTIVE_TIMEOUT"
EXIT_TIMEOUT_VARIABLE: Final = "SAR_EXIT_TIMEOUT"
#: How often a rank stamps its progress record, and a self-registered process heartbeats (seconds).
HEARTBEAT_INTERVAL_VARIABLE: Final = "SARCOMM_HEARTBEAT_INTERVAL"
#: The client settings of ``sar-worker --token-file/--tls-ca/--tls-cert/--tls-key``, which a process
#: that registers itself reads too.
TOKEN_FILE_VARIABLE: Final = "SARCOMM_TOKEN_FILE"
TLS_CA_VARIABLE: Final = "SARCOMM_TLS_CA"
TLS_CERT_VARIABLE: Final = "SARCOMM_TLS_CERT"
TLS_KEY_VARIABLE: Final = "SARCOMM_TLS_KEY"
#: OpenMP's thread count: ``sar-worker`` shares the host's CPUs among its ranks unless it is set.
OMP_THREADS_VARIABLE: Final = "OMP_NUM_THREADS"

#: The interface a rank uses, as SAR documents it; the backends' own variables below get its value.
SOCKET_NAME_VARIABLE: Final = "SAR_SOCKET_NAME"
#: Gloo's interface variable (the one a rank's log line shows).
GLOO_INTERFACE_VARIABLE: Final = "GLOO_SOCKET_IFNAME"
#: The backends' own interface variables; every one gets the interface the coordinator chose.
INTERFACE_VARIABLES: Final = (
    GLOO_INTERFACE_VARIABLE,
    "NCCL_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "CCL_SOCKET_IFNAME",
)

#: Where ``sar-worker`` tells a rank to keep its progress record (a small memory-mapped file it
#: reads every heartbeat interval); see :mod:`sarcomm.worker.progress`.
PROGRESS_FILE_VARIABLE: Final = "SAR_PROGRESS_FILE"
#: The port a rank serves ``/metrics`` on (P + local rank; 0 any free port; -1 off).
METRICS_PORT_VARIABLE: Final = "SAR_METRICS_PORT"
#: The address a rank serves ``/metrics`` on (an IP address of its host; unset: every interface).
METRICS_HOST_VARIABLE: Final = "SAR_METRICS_HOST"
#: Under ``torchrun --rdzv-backend=sarcomm``: the node's directory where each worker notes the
#: ``/metrics`` endpoint it bound, for the torchrun agent to report (see
#: :mod:`sarcomm.worker.endpoints`). Set there, a worker serves ``/metrics`` (port
#: ``SAR_METRICS_PORT`` + ``LOCAL_RANK``, or any free port when unset).
ENDPOINTS_DIR_VARIABLE: Final = "SAR_ENDPOINTS_DIR"
#: The extra ports reserved with the master port, for SAR's sampling workers (its worker k's
#: process group listens on ``master_port() + k + 1``): the ports ``MASTER_PORT+1`` to
#: ``MASTER_PORT+K``, comma-separated, K being ``sar-worker --extra-ports`` or
#: ``coord_ip_init(..., extra_ports=K)``; unset when K is 0. The rule is
#: :func:`sarcomm.common.ports.extra_ports`.
EXTRA_PORTS_VARIABLE: Final = "SAR_EXTRA_PORTS"
#: The most extra ports a job may reserve (SAR starts one sampling worker per DataLoader worker).
MAX_EXTRA_PORTS: Final = 64
#: The pid of the ``sar-worker`` that started a rank; a rank whose agent is gone stops itself.
AGENT_PID_VARIABLE: Final = "SAR_AGENT_PID"
#: Zero-code metrics of a rank started by ``sar-worker`` or ``torchrun --rdzv-backend=sarcomm``
#: (:mod:`sarcomm.worker.autometrics`): on unless "0" (``sar-worker --no-auto-metrics`` and
#: torchrun's ``--rdzv-conf auto_metrics=0`` set it so).
AUTO_METRICS_VARIABLE: Final = "SAR_AUTO_METRICS"
#: Set by the rank that turned its zero-code metrics on, to its pid: a process it starts (a
#: DataLoader worker, a spawned helper) inherits the rank's variables but is not the rank.
AUTO_METRICS_PID_VARIABLE: Final = "SAR_AUTO_METRICS_PID"
#: torch's own switch for its ``torch.backends`` entry points ("0": none is loaded, sarcomm's
#: zero-code metrics included).
TORCH_AUTOLOAD_VARIABLE: Final = "TORCH_DEVICE_BACKEND_AUTOLOAD"
#: torch's switch for the CUDA events ProcessGroupNCCL records around each work: a rank with
#: zero-code metrics on sets it to 1 unless it is set (the completion hook's GPU time needs it).
TORCH_NCCL_TIMING_VARIABLE: Final = "TORCH_NCCL_ENABLE_TIMING"

#: The coordinator's documented defaults (``--heartbeat-interval``, ``--heartbeat-misses``,
#: ``--join-timeout``), in seconds and counts; clients size their own deadlines from them.
DEFAULT_HEARTBEAT_INTERVAL: Final = 1.0
DEFAULT_HEARTBEAT_MISSES: Final = 3
DEFAULT_JOIN_TIMEOUT: Final = 600.0
#: Seconds a Join's client deadline runs past a join timeout the caller gave: the deadline is the
#: caller's (reaching the coordinator counts against it), but a world that forms at the last
#: moment must still be written and its answer sent, and so must the coordinator's word on why it
#: did not form, which is why the coordinator stops waiting this long before the client's deadline.
JOIN_ANSWER_SLACK_S: Final = 2.0
#: An elastic world's last call (torchrun's ``--rdzv-conf last_call_timeout``), in seconds: once
#: min_members have joined, the world forms when this long passes without a new arrival. A few
#: seconds: long enough for nodes started together to arrive, short enough that survivors of a lost
#: node train again soon (torch's own backends wait 30 s).
DEFAULT_LAST_CALL_TIMEOUT: Final = 3.0
#: The longest last call a Join may ask for, in seconds: an hour is already far beyond any use.
#: The coordinator refuses more; the clients refuse it first, naming their own setting.
MAX_LAST_CALL_TIMEOUT: Final = 3600.0
#: The most restarts a Join may ask for (the coordinator refuses more; the clients first).
MAX_RESTARTS: Final = 1_000_000
#: The largest count of ranks or members the protocol carries (its int32 fields); a coordinator's
#: --max-world-size may allow fewer.
MAX_WORLD_SIZE: Final = 2**31 - 1


class EventKind(enum.IntEnum):
    """What a job event reports; the numbers are those of ``sarcomm.v1.JobEvent.Kind``.

    ``JOB_RESTARTING``: an elastic job's generation ended so that its world re-forms (a
    re-rendezvous), which is not a failure. A client maps any number it does not know to
    ``UNSPECIFIED``.
    """

    UNSPECIFIED = 0
    WORLD_FORMED = 1
    MEMBER_FAILED = 2
    JOB_FINISHED = 3
    JOB_FAILED = 4
    JOB_RESTARTING = 5


class FailureReason(str, enum.Enum):
    """Why a member failed, as a bounded value: the ``reason`` label of
    ``sar_coordinator_member_failures_total`` and the ``failure`` field on the wire. The free text
    beside it (``exited with code 3``) is for people; nothing parses it."""

    MISSED_HEARTBEATS = "missed_heartbeats"
    CONNECTION_LOST = "connection_lost"
    KILLED = "killed"
    EXIT_CODE = "exit_code"
    REPORTED = "reported"


#: What a job name may be (it names the job's keys in the store and its labels in metrics;
#: torchrun's --rdzv-id is one).
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
JOB_NAME_RULE = "must be 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"


def is_job_name(name: str) -> bool:
    """Whether ``name`` keeps :data:`JOB_NAME_RULE`."""
    return JOB_NAME.fullmatch(name) is not None
