"""The one place where sarcomm errors become gRPC statuses, every call is counted, and the
shared token is checked.

Wrapping the method handlers (rather than each servicer method) means a new RPC cannot forget
any of it: its errors are mapped, its calls appear in ``sar_coordinator_rpcs_total``, and it is
refused without the token. Only ``grpc.health.v1.Health`` answers without one: it reveals nothing,
and container health checks cannot carry a secret.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from sarcomm.coordinator.errors import SarcommError, UnauthenticatedError, to_status
from sarcomm.coordinator.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)


class StatusInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, metrics: CoordinatorMetrics, token: str | None = None) -> None:
        self._metrics = metrics
        self._token = token
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
            token = None if handler_call_details.method.startswith(UNAUTHENTICATED_PREFIX) else self._token
            wrapped = _wrap(handler, method, self._metrics, token)
            self._wrapped[handler_call_details.method] = wrapped
        return wrapped


def _wrap(
    handler: grpc.RpcMethodHandler[Any, Any], method: str, metrics: CoordinatorMetrics, token: str | None
) -> grpc.RpcMethodHandler[Any, Any]:
    counter = metrics.rpcs
    duration = metrics.rpc_duration.labels(method)

    async def finish(
        context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None, start: float
    ) -> None:
        duration.observe(time.perf_counter() - start)
        if isinstance(error, SarcommError):
            status, details = to_status(error)
            counter.labels(method, status.name).inc()
            await context.abort(status, details)
        if isinstance(error, asyncio.CancelledError):
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
            try:
                _authenticate(context, token)
                response = await behavior(request, context)
            except BaseException as error:
                await finish(context, error, start)
                raise
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
            try:
                _authenticate(context, token)
                async for response in behavior(request, context):
                    yield response
            except BaseException as error:
                await finish(context, error, start)
                raise
            await finish(context, None, start)

        return wrapped

    kwargs = {
        "request_deserializer": handler.request_deserializer,
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
    """True when ``header`` is ``Bearer <token>``; constant time in the token's content."""
    return hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


def _is_abort(error: BaseException) -> bool:
    # context.abort() raises grpc.aio's AbortError; the status is already set on the context.
    return type(error).__name__ == "AbortError"


def _code_name(code: object) -> str:
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "OK"
