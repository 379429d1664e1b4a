"""The process environment itself, and what the worker side writes into it.

:func:`process_environ` is the one place the rank side touches ``os.environ``: the library's
entry points call it and hand the mapping to :mod:`~sarcomm.worker.launch_env.settings` (which
reads it) and ``.update`` it with what this module builds. :func:`member_environment` is the
contract's variables for one member, built the same way by ``sar-worker`` for each rank it starts
and by a process that registers itself.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from sarcomm.common.constants import (
    BACKEND_VARIABLE,
    COORD_VARIABLE,
    EXTRA_PORTS_VARIABLE,
    GENERATION_VARIABLE,
    JOB_VARIABLE,
    LOCAL_RANK_VARIABLE,
    LOCAL_WORLD_SIZE_VARIABLE,
    MASTER_ADDR_VARIABLE,
    MASTER_PORT_VARIABLE,
    MEMBER_ID_VARIABLE,
    MEMBER_SECRET_VARIABLE,
    RANK_VARIABLE,
    RESTART_COUNT_VARIABLE,
    SOCKET_NAME_VARIABLE,
    WORLD_SIZE_VARIABLE,
)
from sarcomm.common.messages import JoinResult
from sarcomm.common.ports import extra_ports

__all__ = ["master_environment", "member_environment", "process_environ"]


def process_environ() -> MutableMapping[str, str]:
    """This process's environment (``os.environ`` itself, so that what is exported reaches the
    backends and child processes): the only access to it on the rank side. Called by the
    library's entry points (``init``, ``coord_ip_init``, ``initialize_comms``,
    ``start_rank_services``, ``nfs_ip_init``) and its exit hook."""
    return os.environ


def member_environment(
    joined: JoinResult,
    index: int,
    coord: str,
    restart_count: int,
    backend: str | None = None,
    extra_ports_count: int = 0,
) -> dict[str, str]:
    """The contract's variables for member ``index`` of ``joined``: ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``SAR_COORD``
    (``coord``), ``SAR_JOB``, ``SAR_GENERATION``, ``SAR_SOCKET_NAME`` (the interface the
    coordinator chose), ``SAR_MEMBER_ID``, ``SAR_MEMBER_SECRET``, ``SAR_RESTART_COUNT``
    (``restart_count``); ``SAR_BACKEND`` when ``backend`` is given, and ``SAR_EXTRA_PORTS`` (the
    ``extra_ports_count`` ports after the master port, comma-separated) when there are any."""
    member = joined.assignments[index]
    env = {
        RANK_VARIABLE: str(member.rank),
        WORLD_SIZE_VARIABLE: str(joined.world_size),
        LOCAL_RANK_VARIABLE: str(member.local_rank),
        LOCAL_WORLD_SIZE_VARIABLE: str(member.local_world_size),
        MASTER_ADDR_VARIABLE: joined.master_addr,
        MASTER_PORT_VARIABLE: str(joined.master_port),
        COORD_VARIABLE: coord,
        JOB_VARIABLE: joined.job,
        GENERATION_VARIABLE: str(joined.generation),
        SOCKET_NAME_VARIABLE: joined.interface,
        MEMBER_ID_VARIABLE: member.member_id,
        MEMBER_SECRET_VARIABLE: member.secret,
        RESTART_COUNT_VARIABLE: str(restart_count),
    }
    if backend is not None:
        env[BACKEND_VARIABLE] = backend
    if extra_ports_count:
        env[EXTRA_PORTS_VARIABLE] = ",".join(map(str, extra_ports(joined.master_port, extra_ports_count)))
    return env


def master_environment(master_addr: str, master_port: int) -> dict[str, str]:
    """``MASTER_ADDR`` and ``MASTER_PORT``, as ``torch.distributed``'s ``env://`` rendezvous reads
    them."""
    return {MASTER_ADDR_VARIABLE: master_addr, MASTER_PORT_VARIABLE: str(master_port)}
