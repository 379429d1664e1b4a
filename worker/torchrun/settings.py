"""What torchrun hands sarcomm's rendezvous handler, checked: ``--rdzv-endpoint``, ``--rdzv-id``,
``--nnodes MIN:MAX`` and ``--rdzv-conf`` (torch's :class:`RendezvousParameters`), and the token
and TLS files from the ``SARCOMM_*`` variables (never on the command line).

``--rdzv-conf`` keys, spelled as torch's own backends spell them where they mean the same:

- ``join_timeout`` (seconds, default 600): how long a node waits for a world to form;
- ``last_call_timeout`` (seconds, default :data:`DEFAULT_LAST_CALL_TIMEOUT`, 3): once MIN nodes
  have joined, the world forms when this long passes without a new arrival;
- ``read_timeout`` (seconds, default 60): the store's timeout (the TCPStore that node rank 0's
  agent serves to the agents and their workers);
- ``auto_metrics`` (``1`` or ``0``, default 1): the workers' zero-code metrics
  (:mod:`sarcomm.worker.autometrics`); 0 exports ``SAR_AUTO_METRICS=0`` to them.

Keys that only torch's other backends use (``timeout``, which torchrun always sets,
``close_timeout``, ``keep_alive_interval``, ...) are ignored; any other key is logged as unknown.

Pure: reads only what it is given, imports neither torch nor gRPC.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from sarcomm.common import durations
from sarcomm.common.addresses import parse_targets
from sarcomm.common.constants import (
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_LAST_CALL_TIMEOUT,
    MAX_LAST_CALL_TIMEOUT,
    TOKEN_FILE_VARIABLE,
    TORCH_AUTOLOAD_VARIABLE,
    is_job_name,
)
from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.common.flags import switch
from sarcomm.common.tls import ClientTls, read_token_file
from sarcomm.worker.launch_env import client_tls_setting

__all__ = ["BACKEND", "DEFAULT_READ_TIMEOUT", "RendezvousSettings", "TorchParameters"]

log = logging.getLogger(__name__)

#: The name torchrun knows the backend by (``--rdzv-backend=sarcomm``, the entry point's name).
BACKEND = "sarcomm"
#: The store's timeout, torch's c10d backend's default (seconds).
DEFAULT_READ_TIMEOUT = 60.0

#: The --rdzv-conf keys this backend reads.
_KEYS = ("join_timeout", "last_call_timeout", "read_timeout", "auto_metrics")
# --rdzv-conf keys of torch's other backends: accepted and ignored, so that an existing command
# line keeps working when only --rdzv-backend changes. (torchrun itself always adds "timeout".)
_OTHER_BACKENDS_KEYS = frozenset(
    {"timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval", "keep_alive_max_attempt",
     "is_host", "store_type", "rank", "protocol", "cacert", "cert", "key"}
)  # fmt: skip


class TorchParameters(Protocol):
    """What this module reads of torch's :class:`RendezvousParameters`."""

    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    config: dict[str, Any]


@dataclass(frozen=True)
class RendezvousSettings:
    """The handler's settings; see the module docstring. ``endpoint`` is one coordinator or its
    replicas, comma-separated, as clients take it."""

    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    auto_metrics: bool = True
    token: str | None = None
    tls: ClientTls | None = None

    @classmethod
    def from_parameters(cls, params: TorchParameters, environ: Mapping[str, str]) -> RendezvousSettings:
        """The settings of torchrun's parameters and the ``SARCOMM_*`` variables in ``environ``.

        Raises:
            InvalidArgumentError: a value breaks its rule; the message names the flag or key, the
                value and the rule, and says what to do.
        """
        if not params.endpoint.strip():
            raise InvalidArgumentError(
                "--rdzv-endpoint is empty: give the coordinator's HOST:PORT (or its replicas', "
                "comma-separated), e.g. --rdzv-endpoint=head:50051"
            )
        try:
            endpoint = ",".join(parse_targets(params.endpoint.strip()))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--rdzv-endpoint {shorten(params.endpoint)}: {exc}") from None
        if not is_job_name(params.run_id):
            raise InvalidArgumentError(
                f"--rdzv-id {shorten(params.run_id)} must be 1 to 128 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit: it names the job at the coordinator"
            )
        if not 1 <= params.min_nodes <= params.max_nodes:
            raise InvalidArgumentError(
                f"--nnodes {params.min_nodes}:{params.max_nodes}: MIN must be at least 1 and at most MAX"
            )
        config = params.config
        unknown = sorted(set(config) - set(_KEYS) - _OTHER_BACKENDS_KEYS)
        if unknown:
            log.warning(
                "--rdzv-conf: %s unknown to the sarcomm backend, ignored (it reads join_timeout, "
                "last_call_timeout, read_timeout and auto_metrics)", ", ".join(unknown),
            )  # fmt: skip
        token_file = environ.get(TOKEN_FILE_VARIABLE)
        auto_metrics = _switch(config, "auto_metrics")
        if auto_metrics and environ.get(TORCH_AUTOLOAD_VARIABLE, "1") != "1":
            log.warning(
                "job=%s: the workers' zero-code metrics are off: %s=%s keeps torch from loading "
                "sarcomm's entry point (a worker that uses sarcomm's library still serves /metrics)",
                params.run_id, TORCH_AUTOLOAD_VARIABLE, environ.get(TORCH_AUTOLOAD_VARIABLE),
            )  # fmt: skip
        return cls(
            endpoint=endpoint,
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            join_timeout=_seconds(config, "join_timeout", DEFAULT_JOIN_TIMEOUT, positive=True),
            last_call_timeout=_seconds(
                config, _KEYS[1], DEFAULT_LAST_CALL_TIMEOUT, positive=False, most=MAX_LAST_CALL_TIMEOUT
            ),
            read_timeout=_seconds(config, "read_timeout", DEFAULT_READ_TIMEOUT, positive=True),
            auto_metrics=auto_metrics,
            token=read_token_file(token_file, TOKEN_FILE_VARIABLE) if token_file else None,
            tls=client_tls_setting(environ),
        )


def _seconds(
    config: Mapping[str, Any],
    key: str,
    default: float,
    *,
    positive: bool,
    most: float = durations.MAX_SECONDS,
) -> float:
    raw = config.get(key)
    if raw is None:
        return default
    try:
        return durations.duration(raw, zero=not positive, most=most)
    except ValueError:
        rule = durations.rule(zero=not positive, most=most)
        raise InvalidArgumentError(f"--rdzv-conf {key}={shorten(raw)} must be {rule}") from None


def _switch(config: Mapping[str, Any], key: str) -> bool:
    """An on/off key (on when absent): the words of :func:`sarcomm.common.flags.switch`."""
    raw = config.get(key)
    if raw is None:
        return True
    with contextlib.suppress(ValueError):
        if str(raw).strip():
            return switch(str(raw))
    raise InvalidArgumentError(f"--rdzv-conf {key}={shorten(raw)} must be 1 (on) or 0 (off)")
