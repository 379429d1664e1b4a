"""torchrun's own launcher on sarcomm: ``torchrun --rdzv-backend=sarcomm --rdzv-endpoint=head:50051``.

Installing sarcomm registers the backend: torch loads the entry point ``sarcomm`` of the group
``torchrun.handlers`` (``torch/distributed/elastic/rendezvous/registry.py``) each time
``torch.distributed.elastic.rendezvous`` is imported, and calls it with no argument; what it
returns, a creator ``creator(RendezvousParameters) -> RendezvousHandler``, is registered under the
entry point's name. This module is what every such import loads, so it loads nothing but the
standard library: the handler (:mod:`.handler`, with gRPC and the coordinator client) loads only
when torchrun asks for the ``sarcomm`` backend.

- :mod:`.settings`: the flags and ``--rdzv-conf`` keys, checked.
- :mod:`.session`: the coordinator client of one agent (joins, heartbeats, what they say of its
  generation).
- :mod:`.handler`: torch's ``RendezvousHandler`` over them.

See ``docs/torchrun.md`` for the user's side.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["create_handler"]

#: The module of the handler, loaded when a handler is first made.
_HANDLER_MODULE = "sarcomm.worker.torchrun.handler"


def create_handler() -> Callable[[Any], Any]:
    """The entry point: torch's registry calls it with no argument and registers what it returns,
    ``creator(params: RendezvousParameters) -> SarcommRendezvousHandler``, as the ``sarcomm``
    backend."""
    return _create


def _create(params: Any) -> Any:
    # Loaded here, not at the top: torch imports this module on every import of its rendezvous
    # package, and the handler's imports (gRPC, protobuf, the client) cost ~0.3 s.
    handler = importlib.import_module(_HANDLER_MODULE)
    return handler.SarcommRendezvousHandler.from_parameters(params)
