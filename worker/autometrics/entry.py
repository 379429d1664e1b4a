"""The ``torch.backends`` entry point: ``import torch`` calls :func:`load` in every process of an
environment where sarcomm is installed (torch 2.5+, ``torch/__init__.py``'s
``_import_device_backends``, after ``torch.distributed`` and ``torch.library`` are loaded).

So it runs in processes that are not ranks too: the torchrun agent, the coordinator's tests, a
notebook. It reads a few variables and imports nothing beyond :mod:`sarcomm.common.constants`
(the launch-environment package would import gRPC: 0.4 s) before deciding; a process that is not
a rank sarcomm started leaves at once. It never raises: torch turns an entry point's exception
into a failed ``import torch``. A rank whose instrumentation fails says so in one line and
trains on without it.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from sarcomm.common.constants import (
    AUTO_METRICS_PID_VARIABLE,
    AUTO_METRICS_VARIABLE,
    ENDPOINTS_DIR_VARIABLE,
    PROGRESS_FILE_VARIABLE,
    RANK_VARIABLE,
    TORCH_NCCL_TIMING_VARIABLE,
)

__all__ = ["Decision", "decide", "load"]

log = logging.getLogger(__name__)

#: What an instrumented rank loads (the library, and torch's dispatcher registrations).
_RUNTIME = "sarcomm.worker.library.zerocode"


@dataclass(frozen=True)
class Decision:
    """Whether to instrument this process. ``launcher`` is "torchrun" or "sar-worker" for a rank
    sarcomm started (else ""); ``reason`` is the line to say when it stays off for a reason its
    user should hear (else "": not a rank, or opted out)."""

    on: bool
    launcher: str = ""
    reason: str = ""


def decide(env: Mapping[str, str], pid: int) -> Decision:
    """The rule, a function of the environment and this process's pid:

    1. A rank has ``RANK``; one of ``torchrun --rdzv-backend=sarcomm`` has ``SAR_ENDPOINTS_DIR``
       (the rendezvous exports it to its workers, after torch's agent imported torch), one of
       ``sar-worker`` has ``SAR_PROGRESS_FILE``. Anything else (torchrun's agent, a rank of another
       launcher, a plain script) is left alone.
    2. A process a rank started inherits those variables: ``SAR_AUTO_METRICS_PID``, set by the rank
       that turned on, tells it apart; the rank itself, seeing its own pid there, is on already (a
       second copy of the entry point, e.g. sarcomm installed twice).
    3. ``SAR_AUTO_METRICS=0`` turns it off; unset or "1" leaves it on; another value is said and
       counts as off.
    """
    if not env.get(RANK_VARIABLE):
        return Decision(False)
    if env.get(ENDPOINTS_DIR_VARIABLE):
        launcher = "torchrun"
    elif env.get(PROGRESS_FILE_VARIABLE):
        launcher = "sar-worker"
    else:
        return Decision(False)
    if env.get(AUTO_METRICS_PID_VARIABLE):
        return Decision(False, launcher)
    value = env.get(AUTO_METRICS_VARIABLE, "").strip()
    if value == "0":
        return Decision(False, launcher)
    if value not in ("", "1"):
        return Decision(
            False,
            launcher,
            f"{AUTO_METRICS_VARIABLE}={value!r} must be 0 (off) or 1 (on); leaving zero-code metrics off",
        )
    return Decision(True, launcher)


def load() -> None:
    """Instrument this process when :func:`decide` says so. Never raises (see the module)."""
    try:
        environ = os.environ
        decision = decide(environ, os.getpid())
        if not decision.on:
            if decision.reason:
                log.warning("sarcomm: rank %s: %s", environ.get(RANK_VARIABLE, "?"), decision.reason)
            return
        environ[AUTO_METRICS_PID_VARIABLE] = str(os.getpid())
        # Before any process group exists: ProcessGroupNCCL reads it when it is made.
        environ.setdefault(TORCH_NCCL_TIMING_VARIABLE, "1")
        # Imported here, not at the top: only a rank pays for the library (the reason this
        # module exists); every other process that imports torch stops above.
        importlib.import_module(_RUNTIME).install(decision.launcher)
    except Exception as exc:  # torch would fail the user's `import torch` with it
        log.warning(
            "sarcomm: rank %s: zero-code metrics are off: %s: %s",
            os.environ.get(RANK_VARIABLE, "?"), type(exc).__name__, exc,
        )  # fmt: skip
