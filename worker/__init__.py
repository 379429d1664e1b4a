"""sarcomm's worker side: ``import sarcomm.worker as sar`` in training code.

A drop-in for SAR's ``sar.comm`` start-up and collectives, every collective timed into Prometheus
metrics, plus the coordinator client. Names load lazily (PEP 562) so that the ``sar-worker`` agent,
which imports this package too, does not pay for importing torch.

Start-up::

    master_ip = sar.coord_ip_init(rank, "head:50051", job="gnn", world_size=8)  # replaces nfs_ip_init
    sar.initialize_comms(rank, world_size, master_ip, "gloo")
    # or, under sar-worker / torchrun / mpirun / srun:
    info = sar.init()
    ...
    sar.finalize()  # optional: Leave now (self-registered processes also leave at exit)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module that defines it
_EXPORTS: dict[str, str] = {
    # start-up
    "coord_ip_init": "sarcomm.worker.library.registration",
    "init": "sarcomm.worker.library.startup",
    "WorkerInfo": "sarcomm.worker.library.startup",
    "initialize_comms": "sarcomm.worker.library.comm",
    "is_initialized": "sarcomm.worker.library.comm",
    "rank": "sarcomm.worker.library.comm",
    "world_size": "sarcomm.worker.library.comm",
    "comm_device": "sarcomm.worker.library.comm",
    "backend": "sarcomm.worker.library.comm",
    "master_ip": "sarcomm.worker.library.comm",
    "master_port": "sarcomm.worker.library.comm",
    "finalize": "sarcomm.worker.library.lifecycle",
    "nfs_ip_init": "sarcomm.worker.library.sar_compat",
    # collectives
    "all_to_all": "sarcomm.worker.library.collectives",
    "all_reduce": "sarcomm.worker.library.collectives",
    "exchange_tensors": "sarcomm.worker.library.collectives",
    "sync_params": "sarcomm.worker.library.collectives",
    "gather_grads": "sarcomm.worker.library.collectives",
    "broadcast": "sarcomm.worker.library.collectives",
    "all_gather": "sarcomm.worker.library.collectives",
    "reduce_scatter": "sarcomm.worker.library.collectives",
    "reduce": "sarcomm.worker.library.collectives",
    "gather": "sarcomm.worker.library.collectives",
    "scatter": "sarcomm.worker.library.collectives",
    "send": "sarcomm.worker.library.collectives",
    "recv": "sarcomm.worker.library.collectives",
    "barrier": "sarcomm.worker.library.collectives",
    "configure_all_to_all": "sarcomm.worker.library.collectives",
    "all_to_all_config": "sarcomm.worker.library.collectives",
    "exchange_single_tensor": "sarcomm.worker.library.sar_compat",
    "CommThread": "sarcomm.worker.library.task_thread",
    "comm_thread": "sarcomm.worker.library.task_thread",
    # coordinator client
    "CoordinatorClient": "sarcomm.common.client.coordinator_client",
    "Assignment": "sarcomm.common.messages",
    "ClientTls": "sarcomm.common.tls",
    # errors
    "PeerFailedError": "sarcomm.common.errors",
    "SarcommError": "sarcomm.common.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "comm":  # SAR's code says ``sar.comm.rank()``: the submodule, loaded on first use
        return importlib.import_module("sarcomm.worker.library.comm")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sarcomm.worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads these on first use
    from sarcomm.common.client.coordinator_client import CoordinatorClient as CoordinatorClient
    from sarcomm.common.errors import PeerFailedError as PeerFailedError
    from sarcomm.common.errors import SarcommError as SarcommError
    from sarcomm.common.messages import Assignment as Assignment
    from sarcomm.common.tls import ClientTls as ClientTls
    from sarcomm.worker.library.collectives import all_gather as all_gather
    from sarcomm.worker.library.collectives import all_reduce as all_reduce
    from sarcomm.worker.library.collectives import all_to_all as all_to_all
    from sarcomm.worker.library.collectives import all_to_all_config as all_to_all_config
    from sarcomm.worker.library.collectives import barrier as barrier
    from sarcomm.worker.library.collectives import broadcast as broadcast
    from sarcomm.worker.library.collectives import configure_all_to_all as configure_all_to_all
    from sarcomm.worker.library.collectives import exchange_tensors as exchange_tensors
    from sarcomm.worker.library.collectives import gather as gather
    from sarcomm.worker.library.collectives import gather_grads as gather_grads
    from sarcomm.worker.library.collectives import recv as recv
    from sarcomm.worker.library.collectives import reduce as reduce
    from sarcomm.worker.library.collectives import reduce_scatter as reduce_scatter
    from sarcomm.worker.library.collectives import scatter as scatter
    from sarcomm.worker.library.collectives import send as send
    from sarcomm.worker.library.collectives import sync_params as sync_params
    from sarcomm.worker.library.comm import backend as backend
    from sarcomm.worker.library.comm import comm_device as comm_device
    from sarcomm.worker.library.comm import initialize_comms as initialize_comms
    from sarcomm.worker.library.comm import is_initialized as is_initialized
    from sarcomm.worker.library.comm import master_ip as master_ip
    from sarcomm.worker.library.comm import master_port as master_port
    from sarcomm.worker.library.comm import rank as rank
    from sarcomm.worker.library.comm import world_size as world_size
    from sarcomm.worker.library.lifecycle import finalize as finalize
    from sarcomm.worker.library.registration import coord_ip_init as coord_ip_init
    from sarcomm.worker.library.sar_compat import exchange_single_tensor as exchange_single_tensor
    from sarcomm.worker.library.sar_compat import nfs_ip_init as nfs_ip_init
    from sarcomm.worker.library.startup import WorkerInfo as WorkerInfo
    from sarcomm.worker.library.startup import init as init
    from sarcomm.worker.library.task_thread import CommThread as CommThread
    from sarcomm.worker.library.task_thread import comm_thread as comm_thread
