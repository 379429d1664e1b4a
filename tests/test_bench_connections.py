"""The load generators' channels are one TCP connection each, and the benchmarks count what the
coordinator holds (``benchmarks/harness.py``: ``own_channel``, ``connections``), against an
in-process gRPC server on port 0."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
CHANNELS = 5


@pytest.fixture(scope="module")
def harness() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("harness")
    finally:
        sys.path.remove(str(BENCHMARKS))


async def test_own_channels_are_one_connection_each_and_counted(harness: ModuleType) -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = f"127.0.0.1:{port}"
    own = [harness.own_channel(target) for _ in range(CHANNELS)]
    shared = [grpc.aio.insecure_channel(target) for _ in range(CHANNELS)]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in own)), 10)
        assert harness.connections(port) == CHANNELS
        # This process holds both ends; the server's are the ones on `port`.
        assert harness.connections(port, os.getpid()) == CHANNELS
        # Channels with equal arguments share gRPC's global subchannel pool: one connection for all.
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in shared)), 10)
        assert harness.connections(port) == CHANNELS + 1
    finally:
        await asyncio.gather(*(c.close(None) for c in own + shared))
        await server.stop(None)
