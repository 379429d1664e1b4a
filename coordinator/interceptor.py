"""The one place where sarcomm errors become gRPC statuses, and where every call is counted.

Wrapping the method handlers (rather than each servicer method) means a new RPC cannot forget
either: its errors are mapped and its calls appear in ``sar_coordinator_rpcs_total``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from sarcomm.coordinator.errors import SarcommError, to_status
from sarcomm.coordinator.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)


class StatusInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self._metrics = metrics
        # Wrapping builds closures and a handler object; do it once per method, not once per call.
        self._wrapped: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return handler  # type: ignore[unreachable]
        wrapped = self._wrapped.get(handler_call_details.method)
        if wrapped is None:
            method = handler_call_details.method.rsplit("/", 1)[-1]
            wrapped = self._wrapped[handler_call_details.method] = _wrap(handler, method, self._metrics)
        return wrapped


def _wrap(
    handler: grpc.RpcMethodHandler[Any, Any], method: str, metrics: CoordinatorMetrics
) -> grpc.RpcMethodHandler[Any, Any]:
    counter = metrics.rpcs
    duration = metrics.rpc_duration.labels(method)

    async def finish(
        context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None, start: float
    ) -> None:
        duration.observe(time.perf_counter() - start)
        if isinstance(error, SarcommError):
            code, details = to_status(error)
            counter.labels(method, code.name).inc()
            await context.abort(code, details)
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


def _is_abort(error: BaseException) -> bool:
    # context.abort() raises grpc.aio's AbortError; the status is already set on the context.
    return type(error).__name__ == "AbortError"


def _code_name(code: object) -> str:
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "OK"
