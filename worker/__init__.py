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

# name -> module that defines it (a bare name is a submodule of this package)
_EXPORTS: dict[str, str] = {
    # start-up
    "coord_ip_init": "registration",
    "init": "startup",
    "WorkerInfo": "startup",
    "initialize_comms": "comm",
    "is_initialized": "comm",
    "rank": "comm",
    "world_size": "comm",
    "comm_device": "comm",
    "backend": "comm",
    "master_ip": "comm",
    "master_port": "comm",
    "finalize": "lifecycle",
    "nfs_ip_init": "sar_compat",
    # collectives
    "all_to_all": "collectives",
    "all_reduce": "collectives",
    "exchange_tensors": "collectives",
    "sync_params": "collectives",
    "gather_grads": "collectives",
    "broadcast": "collectives",
    "all_gather": "collectives",
    "reduce_scatter": "collectives",
    "reduce": "collectives",
    "gather": "collectives",
    "scatter": "collectives",
    "send": "collectives",
    "recv": "collectives",
    "barrier": "collectives",
    "configure_all_to_all": "collectives",
    "all_to_all_config": "collectives",
    "exchange_single_tensor": "sar_compat",
    "CommThread": "task_thread",
    "comm_thread": "task_thread",
    # coordinator client
    "CoordinatorClient": "sarcomm.common.client",
    "Assignment": "sarcomm.common.messages",
    "ClientTls": "sarcomm.common.tls",
    # errors
    "PeerFailedError": "sarcomm.common.errors",
    "SarcommError": "sarcomm.common.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "comm":  # SAR's code says ``sar.comm.rank()``: the submodule, loaded on first use
        return importlib.import_module("sarcomm.worker.comm")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sarcomm.worker' has no attribute {name!r}")
    qualified = module if "." in module else f"sarcomm.worker.{module}"
    value = getattr(importlib.import_module(qualified), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads these on first use
    from sarcomm.common.client import CoordinatorClient as CoordinatorClient
    from sarcomm.common.errors import PeerFailedError as PeerFailedError
    from sarcomm.common.errors import SarcommError as SarcommError
    from sarcomm.common.messages import Assignment as Assignment
    from sarcomm.common.tls import ClientTls as ClientTls
    from sarcomm.worker.collectives import all_gather as all_gather
    from sarcomm.worker.collectives import all_reduce as all_reduce
    from sarcomm.worker.collectives import all_to_all as all_to_all
    from sarcomm.worker.collectives import all_to_all_config as all_to_all_config
    from sarcomm.worker.collectives import barrier as barrier
    from sarcomm.worker.collectives import broadcast as broadcast
    from sarcomm.worker.collectives import configure_all_to_all as configure_all_to_all
    from sarcomm.worker.collectives import exchange_tensors as exchange_tensors
    from sarcomm.worker.collectives import gather as gather
    from sarcomm.worker.collectives import gather_grads as gather_grads
    from sarcomm.worker.collectives import recv as recv
    from sarcomm.worker.collectives import reduce as reduce
    from sarcomm.worker.collectives import reduce_scatter as reduce_scatter
    from sarcomm.worker.collectives import scatter as scatter
    from sarcomm.worker.collectives import send as send
    from sarcomm.worker.collectives import sync_params as sync_params
    from sarcomm.worker.comm import backend as backend
    from sarcomm.worker.comm import comm_device as comm_device
    from sarcomm.worker.comm import initialize_comms as initialize_comms
    from sarcomm.worker.comm import is_initialized as is_initialized
    from sarcomm.worker.comm import master_ip as master_ip
    from sarcomm.worker.comm import master_port as master_port
    from sarcomm.worker.comm import rank as rank
    from sarcomm.worker.comm import world_size as world_size
    from sarcomm.worker.lifecycle import finalize as finalize
    from sarcomm.worker.registration import coord_ip_init as coord_ip_init
    from sarcomm.worker.sar_compat import exchange_single_tensor as exchange_single_tensor
    from sarcomm.worker.sar_compat import nfs_ip_init as nfs_ip_init
    from sarcomm.worker.startup import WorkerInfo as WorkerInfo
    from sarcomm.worker.startup import init as init
    from sarcomm.worker.task_thread import CommThread as CommThread
    from sarcomm.worker.task_thread import comm_thread as comm_thread
