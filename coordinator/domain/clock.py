"""The two clocks the coordinator reads, behind one small interface so tests can drive them.

Liveness is judged on the monotonic clock (a wall clock stepped by NTP must not fail or revive
members); what users see (when a world formed, when a rank last reported) is Unix time.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds for deadlines and liveness, wall (Unix) seconds for what users see."""

    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """:class:`Clock` on ``time.monotonic`` and ``time.time``."""

    # The functions themselves, not methods wrapping them: every heartbeat reads the clock.
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)


SYSTEM_CLOCK = SystemClock()
