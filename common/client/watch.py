"""The Watch stream of a job's events over a :class:`~sarcomm.common.client.replicas.Replicas`:
opened at the leader, opened again there when it breaks or the leader moves, within its deadline
(see :meth:`CoordinatorClient.watch <sarcomm.common.client.coordinator_client.CoordinatorClient.watch>`,
which documents what it yields and raises)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from sarcomm.common.client.replicas import Replicas, cancel_call
from sarcomm.common.errors import CoordinatorUnavailableError
from sarcomm.common.messages import Event
from sarcomm.v1 import coordinator_pb2 as pb

__all__ = ["watch_events"]

log = logging.getLogger(__name__)


async def watch_events(replicas: Replicas, job: str, generation: int, timeout: float) -> AsyncIterator[Event]:
    """Yield ``job``'s events from ``generation`` until ``timeout`` seconds pass (then end
    quietly), each once, re-attaching at the leader when the stream breaks or the leader moves."""
    started = time.monotonic()
    seen: set[Event] = set()
    while True:
        target = await replicas.replica("Watch")
        left = timeout - (time.monotonic() - started)
        call = replicas.stub_for(target).Watch(
            pb.WatchRequest(job=job, generation=generation),
            timeout=max(left, 0.001),
            metadata=replicas.metadata,
            wait_for_ready=False,
        )
        # Another call following a new leader: this stream goes there too (the old leader may
        # hang with its connection up, and a watch hears nothing for long stretches).
        moved = asyncio.ensure_future(replicas.left_behind(target))
        moved.add_done_callback(functools.partial(cancel_call, call))
        try:
            async for msg in call:
                replicas.answered(target)
                event = Event.from_proto(msg)
                if event not in seen:
                    seen.add(event)
                    yield event
            return
        except asyncio.CancelledError:
            if not moved.done() or moved.cancelled():
                raise
            log.info("Watch of job %s: re-attaching at the leader %s", job, replicas.target)
        except grpc.aio.AioRpcError as err:
            error = replicas.translate(err, "Watch", timeout, started)
            if (
                err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                and isinstance(error, CoordinatorUnavailableError)
                and replicas.connected()
            ):
                return  # our own deadline on an established stream: a normal end
            delay = replicas.after_failure(target, err)
            left = timeout - (time.monotonic() - started)
            if delay is None or left <= delay:
                raise await replicas.explained(error) from err
            await asyncio.sleep(delay)
        finally:
            moved.cancel()
            call.cancel()
