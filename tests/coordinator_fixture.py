"""A coordinator in this process, on port 0, with a clock the test moves.

Liveness, stalls and restarts are about time; with :class:`tests.helpers.FakeClock` a test says exactly when
"now" is, and calls the sweep itself instead of sleeping until a real one comes. Everything else
is real: the gRPC server and HTTP side on loopback, the client, the state file.

The coordinator's own periodic sweep still runs (every interval / 4 of real time); it reads the
same fake clock, so it can only reach the verdicts the test's own sweep would reach at that
instant. Tests therefore assert on state (the member's state, the events), never on which sweep
got there first.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.domain.model import Job, Member
from sarcomm.coordinator.server import Coordinator
from tests.helpers import FakeClock, wait_for_async

LOOPBACK = (InterfaceInfo("lo", ("127.0.0.1",), InterfaceKind.LOOPBACK),)


@dataclass
class InProcessCoordinator:
    coordinator: Coordinator
    clock: FakeClock

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.coordinator.grpc_port}"

    def client(self, **kwargs: Any) -> CoordinatorClient:
        return CoordinatorClient(self.target, timeout=kwargs.pop("timeout", 10.0), **kwargs)

    def sweep(self) -> list[tuple[Job, Member]]:
        """Run the liveness sweep now (at the fake clock's time); returns the members it failed."""
        return self.coordinator.membership.sweep()

    def member(self, job: str, rank: int) -> Member:
        found = self.coordinator.membership.job(job)
        assert found is not None, f"no job {job!r}"
        return next(m for m in found.members if m.rank == rank)


@contextlib.asynccontextmanager
async def in_process_coordinator(
    clock: FakeClock, state: Path | None = None, **settings: Any
) -> AsyncIterator[InProcessCoordinator]:
    """Start a :class:`Coordinator` on ``127.0.0.1:0`` (gRPC and HTTP) reading ``clock``; stop it on
    exit. ``settings`` are :class:`CoordinatorConfig` fields (default interval 1 s x 3 misses)."""
    config = CoordinatorConfig(listen="127.0.0.1:0", http="127.0.0.1:0", state=state, **settings)
    # start() tunes the collector for a long-lived daemon; the test process gets its own back.
    threshold = gc.get_threshold()
    coordinator = Coordinator(config, clock=clock)
    await coordinator.start()
    try:
        if config.store is not None:
            # On etcd: serve once this coordinator leads (at once, unless a dead leader's lease
            # still holds the key: then within its TTL).
            await wait_for_async(
                lambda: coordinator.seat.serving_term() is not None,
                15,
                what=f"the in-process coordinator to lead: {config.store}",
            )
        yield InProcessCoordinator(coordinator, clock)
    finally:
        await coordinator.stop()
        gc.set_threshold(*threshold)
        gc.unfreeze()
