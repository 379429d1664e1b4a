"""Names and values both sides agree on, each defined once: backends, the environment a rank is
given, the interface variables of the backends, event kinds and failure reasons."""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "AGENT_PID_VARIABLE",
    "BACKENDS",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_HEARTBEAT_MISSES",
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_LAST_CALL_TIMEOUT",
    "EXTRA_PORTS_VARIABLE",
    "INTERFACE_VARIABLES",
    "MAX_EXTRA_PORTS",
    "METRICS_HOST_VARIABLE",
    "METRICS_PORT_VARIABLE",
    "PROGRESS_FILE_VARIABLE",
    "SOCKET_NAME_VARIABLE",
    "EventKind",
    "FailureReason",
]

#: torch.distributed backends a job may name; "auto" lets ``initialize_comms`` choose (nccl when
#: CUDA is there, else gloo). The wire also accepts "" for "not said".
BACKENDS: Final = ("auto", "gloo", "nccl", "ccl", "mpi", "ucc")

#: The interface a rank uses, as SAR documents it; the backends' own variables below get its value.
SOCKET_NAME_VARIABLE: Final = "SAR_SOCKET_NAME"
#: The backends' own interface variables; every one gets the interface the coordinator chose.
INTERFACE_VARIABLES: Final = (
    "GLOO_SOCKET_IFNAME",
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

#: The coordinator's documented defaults (``--heartbeat-interval``, ``--heartbeat-misses``,
#: ``--join-timeout``), in seconds and counts; clients size their own deadlines from them.
DEFAULT_HEARTBEAT_INTERVAL: Final = 1.0
DEFAULT_HEARTBEAT_MISSES: Final = 3
DEFAULT_JOIN_TIMEOUT: Final = 600.0
#: An elastic world's last call (torchrun's ``--rdzv-conf last_call_timeout``), in seconds: once
#: min_members have joined, the world forms when this long passes without a new arrival. A few
#: seconds: long enough for nodes started together to arrive, short enough that survivors of a lost
#: node train again soon (torch's own backends wait 30 s).
DEFAULT_LAST_CALL_TIMEOUT: Final = 3.0


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
