"""The one rule for every duration a user gives sarcomm, in seconds: a flag (``--join-timeout``),
a variable (``SAR_COLLECTIVE_TIMEOUT``), a torchrun ``--rdzv-conf`` key (``join_timeout``,
``read_timeout``), a ``Join`` field (``join_timeout_seconds``).

A duration is a finite number of seconds, at most :data:`MAX_SECONDS` (a week). Beyond that
nothing is meant, and the primitives the value reaches break with a traceback: a thread's wait
(``OverflowError: timestamp out of range for platform time_t`` past ``threading.TIMEOUT_MAX``),
torch's ``TCPStore`` timeout (a ``timedelta``: ``OverflowError`` past about 10^13 s), gRPC's
deadlines. Each reader checks its value here and refuses it in its own words (the name as the user
wrote it, the value, :func:`rule`).
"""

from __future__ import annotations

import math
from typing import Final

from sarcomm.common.errors import InvalidArgumentError

__all__ = ["MAX_SECONDS", "checked", "duration", "rule"]

#: The longest duration any setting takes, in seconds: a week.
MAX_SECONDS: Final = 604_800.0


def rule(*, zero: bool = False, most: float = MAX_SECONDS) -> str:
    """The rule in words: positive (or, with ``zero``, >= 0) and at most ``most`` (a setting with a
    tighter bound of its own passes it; :data:`MAX_SECONDS` by default)."""
    kind = "a number of seconds >= 0" if zero else "a positive number of seconds"
    return f"{kind}, at most {most:g}" + (" (a week)" if most == MAX_SECONDS else "")


def duration(value: object, *, zero: bool = False, most: float = MAX_SECONDS) -> float:
    """``value`` (a number, or its text) as seconds under :func:`rule` (``most`` at most
    :data:`MAX_SECONDS`).

    Raises:
        ValueError: not a number, or outside the rule (the caller names the setting).
    """
    if isinstance(value, bool):
        raise ValueError(value)
    try:
        seconds = float(value) if isinstance(value, (int, float, str)) else math.nan
    except ValueError:
        seconds = math.nan
    low_ok = seconds >= 0 if zero else seconds > 0
    if not (math.isfinite(seconds) and low_ok and seconds <= min(most, MAX_SECONDS)):
        raise ValueError(value)
    return seconds


def checked(value: float, shown: str, *, zero: bool = False) -> float:
    """``value`` under :func:`rule`, for a caller's argument: ``shown`` is how the message names
    it and its value (``f"timeout={timeout!r}"``).

    Raises:
        InvalidArgumentError: ``<shown> must be <rule>.``
    """
    try:
        return duration(value, zero=zero)
    except ValueError:
        raise InvalidArgumentError(f"{shown} must be {rule(zero=zero)}.") from None
