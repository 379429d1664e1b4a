"""The one place where sarcomm errors become gRPC statuses, every call is counted, the shared
token is checked, requests are decoded and open streams are bounded.

Wrapping the method handlers (rather than each servicer method) means a new RPC cannot forget
any of it: its errors are mapped, its calls appear in ``sar_coordinator_rpcs_total``, it is
refused without the token, a request that is not its message type gets INVALID_ARGUMENT (gRPC
itself would answer UNKNOWN), and a stream beyond ``max_streams`` gets RESOURCE_EXHAUSTED. Only
``grpc.health.v1.Health`` answers without the token: it reveals nothing, and container health
checks cannot carry a secret.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from sarcomm.common.errors import (
    LEADER_METADATA_KEY,
    InvalidArgumentError,
    NotLeaderError,
    ResourceExhaustedError,
    SarcommError,
    UnauthenticatedError,
    shorten,
)
from sarcomm.common.status import to_status
from sarcomm.coordinator.api.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)


class StreamSlots:
    """How many streaming calls are open, against ``limit``; shared by every method's wrapper."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def take(self, method: str) -> None:
        if self.open >= self.limit:
            raise ResourceExhaustedError(
                f"{method}: the coordinator already holds {self.open} open streams, its limit "
                f"max_streams (--max-streams) {self.limit}; retry later"
            )
        self.open += 1

    def give_back(self) -> None:
        self.open -= 1


class StatusInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(
        self, metrics: CoordinatorMetrics, token: str | None = None, max_streams: int = 65536
    ) -> None:
        self._metrics = metrics
        self._token = token
        self.streams = StreamSlots(max_streams)
        # Health's Watch answers without the token: its streams get a pool of their own, so that
        # anonymous callers can never take the slots that members' heartbeat streams need.
        self.public_streams = StreamSlots(min(max_streams, PUBLIC_STREAMS))
        # Wrapping builds closures and a handler object; do it once per method, not once per call.
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return handler  # type: ignore[return-value]
        wrapped = self._wrapped.get(handler_call_details.method)
        if wrapped is None:
            method = handler_call_details.method.rsplit("/", 1)[-1]
            public = handler_call_details.method.startswith(UNAUTHENTICATED_PREFIX)
            token = None if public else self._token
            slots = self.public_streams if public else self.streams
            wrapped = _wrap(handler, method, self._metrics, token, slots)
            self._wrapped[handler_call_details.method] = wrapped
        return wrapped


def _wrap(
    handler: grpc.RpcMethodHandler[Any, Any],
    method: str,
    metrics: CoordinatorMetrics,
    token: str | None,
    streams: StreamSlots,
) -> grpc.RpcMethodHandler[Any, Any]:
    counter = metrics.rpcs
    duration = metrics.rpc_duration.labels(method)
    decode = _decoder(handler.request_deserializer, method)
    is_stream = not handler.unary_unary

    def arguments(request: Any) -> Any:
        """The request (or request iterator) as the handler expects it: decoded, in our error path."""
        if handler.request_streaming:
            return _decoded(request, decode)
        return decode(request)

    async def finish(
        context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None, start: float
    ) -> None:
        duration.observe(time.perf_counter() - start)
        if isinstance(error, SarcommError):
            status, details = to_status(error)
            counter.labels(method, status.name).inc()
            if isinstance(error, NotLeaderError):
                # A standby's answer: clients follow the leader's address in the trailing metadata.
                await context.abort(status, details, trailing_metadata=((LEADER_METADATA_KEY, error.leader),))
            await context.abort(status, details)
        if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            # The caller went away: cancelled, or it stopped reading a stream and gRPC closed the
            # handler's generator. There is nobody to send a status to, and awaiting anything now
            # would break the generator's close.
            counter.labels(method, "CANCELLED").inc()
            return
        if error is not None and not _is_abort(error):
            log.error("%s failed unexpectedly", method, exc_info=error)
            counter.labels(method, "INTERNAL").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed inside the coordinator")
        code: object = context.code() if error is not None else None
        counter.labels(method, _code_name(code)).inc()

    def unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            start = time.perf_counter()
            slot = False
            try:
                _authenticate(context, token)
                if is_stream:
                    streams.take(method)
                    slot = True
                response = await behavior(arguments(request), context)
            except BaseException as error:
                await finish(context, error, start)
                raise
            finally:
                if slot:
                    streams.give_back()
            await finish(context, None, start)
            return response

        return wrapped

    def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            # Handlers that stream with ``await context.write(...)`` (grpc_health's Watch) are
            # coroutines, not generators: wrap them like a unary handler.
            return unary(behavior)

        async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            start = time.perf_counter()
            slot = False
            try:
                _authenticate(context, token)
                streams.take(method)
                slot = True
                async for response in behavior(arguments(request), context):
                    yield response
            except BaseException as error:
                await finish(context, error, start)
                raise
            finally:
                if slot:
                    streams.give_back()
            await finish(context, None, start)

        return wrapped

    kwargs = {
        # The wrapper decodes (see arguments): gRPC's own decoding failure would be UNKNOWN.
        "request_deserializer": None,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kwargs)
    return handler


UNAUTHENTICATED_PREFIX = "/grpc.health.v1.Health/"
#: Open streams of the methods that need no token (health Watch), at most.
PUBLIC_STREAMS = 256


def _decoder(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[Any], Any]:
    """Bytes to the request message, or INVALID_ARGUMENT naming the method and the bytes."""
    if deserializer is None:
        return lambda raw: raw

    def decode(raw: Any) -> Any:
        try:
            return deserializer(raw)
        except (DecodeError, ValueError, TypeError) as error:
            # protobuf reports a field's bad UTF-8 as a DecodeError too; either way the sender
            # must learn which call it was, not see UNKNOWN.
            raise InvalidArgumentError(
                f"request {shorten(raw)} must be a serialized {method} request message: {error}"
            ) from None

    return decode


async def _decoded(requests: AsyncIterator[Any], decode: Callable[[Any], Any]) -> AsyncIterator[Any]:
    async for raw in requests:
        yield decode(raw)


def _authenticate(context: grpc.aio.ServicerContext[Any, Any], token: str | None) -> None:
    """Refuse a call whose ``authorization`` metadata is not ``Bearer <token>``.

    The message says nothing about what exists, and the comparison takes the same time however
    much of the token matches.
    """
    if token is None:
        return
    sent = ""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            sent = value if isinstance(value, str) else value.decode(errors="replace")
    if not bearer_matches(sent, token):
        raise UnauthenticatedError("the call carries no valid token (send 'authorization: Bearer <token>')")


def bearer_matches(header: str, token: str) -> bool:
    """True when ``header`` is ``Bearer <token>``; constant time in the token's content and length.

    Both sides are hashed first: ``compare_digest`` returns early on a length mismatch, which
    would tell a prober how long the token is.
    """
    sent = hashlib.sha256(header.encode(errors="replace")).digest()
    expected = hashlib.sha256(f"Bearer {token}".encode()).digest()
    return hmac.compare_digest(sent, expected)


def _is_abort(error: BaseException) -> bool:
    # context.abort() raises grpc.aio's AbortError; the status is already set on the context.
    return type(error).__name__ == "AbortError"


def _code_name(code: object) -> str:
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "OK"
