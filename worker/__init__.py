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
import importlib.util
import types
from typing import TYPE_CHECKING, Any

_LIBRARY = "sarcomm.worker.library"


def _public(library: types.ModuleType) -> list[str]:
    """The library's public names: what its ``__init__`` re-exports, and SAR's ``comm`` module."""
    return sorted(
        name
        for name, value in vars(library).items()
        if not name.startswith("_") and (not isinstance(value, types.ModuleType) or name == "comm")
    )


def __getattr__(name: str) -> Any:
    # PEP 562: called only for names not yet in this module. Loading the library imports torch,
    # which the sar-worker agent (sarcomm.worker.agent, torch-free) never pays for.
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module 'sarcomm.worker' has no attribute {name!r}")
    # `from sarcomm.worker import bandwidth` asks here before it imports the submodule: a
    # submodule is imported as itself, never through the library (the agent's `bench` did that,
    # and every sar-worker process paid for torch).
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    library = importlib.import_module(_LIBRARY)
    public = _public(library)
    if name == "__all__":
        return public
    if name not in public:
        raise AttributeError(f"module 'sarcomm.worker' has no attribute {name!r}")
    value = getattr(library, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_public(importlib.import_module(_LIBRARY))))


if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads these on first use
    from sarcomm.worker.library import *  # noqa: F403
