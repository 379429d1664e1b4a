"""Bandwidth of a collective, nccl-tests' way: the one owner of the formulas that ``sar-worker
bench`` prints and that a rank's ``/metrics`` exports for the dashboards.

nccl-tests (``doc/PERFORMANCE.md``): ``algbw = size / time``, with ``size`` the call's larger
buffer, and ``busbw = algbw x factor``, the traffic of each link, which compares with the
hardware's bandwidth whatever the world size: all_reduce ``2 (n - 1) / n``; all_gather,
reduce_scatter and all_to_all ``(n - 1) / n``; broadcast and reduce 1.

A rank's metrics count the bytes it *sent* (``sar_collective_bytes_total``), not ``size``: all_reduce
sends its whole buffer (``size``), all_gather its input (``size / n``), reduce_scatter and
all_to_all the parts for the other ranks (``size (n - 1) / n``), broadcast the buffer at the root.
:func:`sent_bus_factor` turns bytes sent per second spent in the op into busbw.

Pure arithmetic: no torch, no I/O (the agent and the ranks both use it).
"""

from __future__ import annotations

from typing import Final

__all__ = ["bus_factor", "sent_bus_factor"]

#: Ops whose buffer is cut into one part per rank (nccl-tests' ``(n - 1) / n`` ops).
_SPLIT_OPS: Final = frozenset({"all_to_all", "all_to_all_unequal", "all_gather", "reduce_scatter"})
#: Ops whose link traffic is the buffer itself.
_WHOLE_OPS: Final = frozenset({"broadcast", "reduce"})


def bus_factor(op: str, world: int) -> float | None:
    """nccl-tests' busbw / algbw of ``op`` in a world of ``world`` >= 1 ranks; None for an op it
    has no formula for (send, barrier, the library's composite ops)."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in _SPLIT_OPS:
        return (world - 1) / world
    if op in _WHOLE_OPS:
        return 1.0
    return None


def sent_bus_factor(op: str, world: int) -> float | None:
    """busbw per byte sent per second of ``op`` (see the module); 0 in a world of one (no link
    carries anything), None where :func:`bus_factor` is."""
    factor = bus_factor(op, world)
    if factor is None or world <= 1:
        return None if factor is None else 0.0
    if op == "all_gather":
        return world * factor  # sent = size / n
    if op in _SPLIT_OPS:
        return world / (world - 1) * factor  # sent = size (n - 1) / n
    return factor
