"""What a rank runs beside its training: the progress record its agent reads, the watch on that
agent, and the ``/metrics`` endpoint.

- Progress: every collective notes its start and end in a :class:`ProgressWriter`. Under
  ``sar-worker`` (``SAR_PROGRESS_FILE``) a daemon thread stamps the shared record every
  heartbeat interval, and stops the rank once its agent (``SAR_AGENT_PID``) is gone; a process that
  registered itself keeps the record in memory for its own heartbeats. The collectives find the
  writer through :func:`add_progress_listener`, so this module never imports them (nor torch).
- Metrics: :func:`start_rank_services` serves ``/metrics`` on the address and port
  :func:`~sarcomm.worker.launch_env.metrics_host_setting` and
  :func:`~sarcomm.worker.launch_env.metrics_port_setting` say (``SAR_METRICS_HOST``,
  ``SAR_METRICS_PORT``), and notes the bound port in the record, from where the heartbeats carry
  it to the coordinator. Under ``torchrun --rdzv-backend=sarcomm`` (``SAR_ENDPOINTS_DIR`` set) a
  worker serves on ``SAR_METRICS_PORT`` + ``LOCAL_RANK`` (any free port when unset) and notes its
  endpoint in that directory (:mod:`sarcomm.worker.endpoints`), from where its torchrun agent's
  heartbeats carry it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.endpoints import EndpointNote, note_endpoint
from sarcomm.worker.launch_env import (
    RankIdentity,
    endpoints_dir_setting,
    local_rank_setting,
    metrics_host_setting,
    metrics_port_setting,
    node_worker_metrics_port,
    process_environ,
    progress_settings,
    rank_identity,
    torchrun_place_setting,
)
from sarcomm.worker.library import metrics
from sarcomm.worker.progress import ProgressWriter

__all__ = [
    "EXIT_GRACE_S",
    "add_progress_listener",
    "install_progress",
    "start_rank_services",
]

log = logging.getLogger(__name__)

#: Seconds an exiting rank's last progress stamp keeps it counted alive while the interpreter
#: finalises.
EXIT_GRACE_S = 60.0

_progress: ProgressWriter | None = None


def install_progress(
    path: Path | None, interval: float, agent_pid: int | None = None, rank_label: str = "?"
) -> ProgressWriter:
    """Note every collective's progress in a :class:`ProgressWriter` (once per process).

    With ``path`` (under ``sar-worker``) a daemon thread stamps the shared record every
    ``interval`` seconds: a rank blocked inside a collective still stamps, a stopped or wedged one
    does not, which is how its agent tells them apart. The same thread stops this rank (SIGTERM to
    itself) once the agent ``agent_pid`` is gone, saying so with ``rank_label``. Without ``path``
    the record stays in this process, read by its own heartbeats.
    """
    global _progress
    if _progress is not None:
        return _progress
    writer = ProgressWriter(path)
    for listener in _progress_listeners:
        listener(writer)
    if path is not None:
        stop = threading.Event()

        def stamp() -> None:
            # Four stamps per interval: the agent reports the stamp's age once per interval, and the
            # coordinator counts a rank's silence from its last stamp, so a stamp a whole interval
            # old would eat an interval of the interval x misses budget of a healthy rank.
            while not stop.wait(interval / 4):
                writer.publish()
                if agent_pid is not None and not _alive(agent_pid):
                    log.error(
                        "rank %s: its sar-worker (pid %d) is gone, so nobody watches it or tells it of "
                        "failures; stopping", rank_label, agent_pid,
                    )  # fmt: skip
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

        thread = threading.Thread(target=stamp, name="sarcomm-progress", daemon=True)
        thread.start()

        def end() -> None:
            # Ended before the interpreter finalises: a daemon thread still running then is torn
            # down with pthread_exit, which aborts the process ("terminate called without an
            # active exception") once torch's C++ runtime is loaded.
            stop.set()
            thread.join(interval + 1.0)
            # Finalising (torch's teardown) can take seconds with nobody left to stamp: a stamp
            # that far ahead keeps the rank alive that long, so the agent does not take an exiting
            # rank for a wedged one.
            writer.publish(stamp=time.time() + EXIT_GRACE_S)

        atexit.register(end)
    _progress = writer
    return writer


_progress_listeners: list[Callable[[ProgressWriter], None]] = []


def add_progress_listener(listener: Callable[[ProgressWriter], None]) -> None:
    """Have ``listener`` told of this process's progress writer: at once when it exists, else when
    :func:`install_progress` makes it. The collectives' timing registers here when it is imported."""
    _progress_listeners.append(listener)
    if _progress is not None:
        listener(_progress)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


#: Set once zero-code metrics (:mod:`sarcomm.worker.library.zerocode`) started this rank's
#: services: the library's own start (``initialize_comms``) then finds them started and neither
#: starts nor says anything a second time (a bad ``SAR_METRICS_PORT`` is said once, not twice).
_started_by_zero_code = False


def start_rank_services(environ: Mapping[str, str] | None = None, *, zero_code: bool = False) -> None:
    """Start what a rank runs beside its training once communication is up; idempotent.
    ``zero_code``: the caller is zero-code metrics, at ``import torch``; a later call does nothing.

    ``initialize_comms`` calls this, so that SAR-style scripts that call it directly (not
    :func:`~sarcomm.worker.library.startup.init`) get the same: under ``sar-worker`` the progress record
    its agent reads (``SAR_PROGRESS_FILE``), and the ``/metrics`` endpoint
    (:func:`~sarcomm.worker.launch_env.metrics_port_setting`), whose bound port goes to the
    coordinator through the agent's or this process's own heartbeats.

    A metrics variable that breaks its rule (``SAR_METRICS_PORT``, ``SAR_METRICS_HOST``, or a
    torchrun worker's first port plus its local rank beyond 65535) and a port that cannot be bound
    are logged once, not raised: losing the endpoint must not stop a training run. (The launchers
    that can refuse a bad variable before training starts do: ``sar-worker``'s flags, torchrun's
    sarcomm rendezvous.) Raises :class:`InvalidArgumentError` for a malformed progress setting.
    """
    global _started_by_zero_code
    if _started_by_zero_code:
        return
    _started_by_zero_code = zero_code
    env = process_environ() if environ is None else environ
    writer = _progress
    # A self-registered process has its (in-memory) writer already: this makes the shared one.
    progress = progress_settings(env) if writer is None else None
    if progress is not None:
        writer = install_progress(progress.path, progress.interval, progress.agent_pid, progress.rank_label)
    identity = rank_identity(env)
    endpoints = endpoints_dir_setting(env)
    try:
        if endpoints is not None:
            port = node_worker_metrics_port(env)
        else:
            port = metrics_port_setting(env, member=bool(identity.member_id))
        host = metrics_host_setting(env)
    except InvalidArgumentError as exc:
        log.error("rank %s: %s Training goes on without the /metrics endpoint.", identity.rank_label, exc)
        return
    if port is None:
        return
    bound = metrics.serving_port()
    if bound is None:
        try:
            _, bound = metrics.start_metrics_server(port, host)
        except OSError as exc:
            log.error(
                "rank %s: cannot serve /metrics on %s port %d (%s); continuing without the endpoint",
                identity.rank_label, host, port, exc,
            )  # fmt: skip
            return
    if writer is not None:
        # The stamping thread (or this process's heartbeats) carries it from the next interval on.
        writer.metrics_port = bound
    if endpoints is not None:
        _note_for_agent(endpoints, identity, env, host, bound)


def _note_for_agent(
    directory: Path, identity: RankIdentity, env: Mapping[str, str], host: str, port: int
) -> None:
    """Note this torchrun worker's endpoint where its agent reads it (logged, not raised, when it
    cannot: the endpoint then goes unlisted, the training on)."""
    try:
        rank, generation = int(identity.rank or ""), int(identity.generation or "0")
        place = torchrun_place_setting(env)
        if place is None:
            raise ValueError("GROUP_RANK, LOCAL_WORLD_SIZE or WORLD_SIZE is unset or not an integer")
        local_rank = local_rank_setting(env) or 0
        note_endpoint(directory, EndpointNote(rank, local_rank, host, port, generation, *place))
    except (OSError, ValueError, InvalidArgumentError) as exc:
        log.warning(
            "rank %s: cannot note its /metrics endpoint (port %d) for its torchrun agent in %s (%s); "
            "the coordinator's /sd will not list it", identity.rank_label, port, directory, exc,
        )  # fmt: skip
