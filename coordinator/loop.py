"""Run a coroutine on uvloop when it is installed, on asyncio's own loop otherwise."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop if it imports; blocks until ``main`` returns."""
    try:
        import uvloop
    except ImportError:
        log.debug("uvloop is not installed; using asyncio's default event loop")
        return asyncio.run(main)
    return uvloop.run(main)
