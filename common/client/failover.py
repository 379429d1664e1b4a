"""Which coordinator replica a client calls next, and how long it waits first: the decisions of
failing over, without gRPC or sleeping (:class:`~sarcomm.common.client.replicas.Replicas` does the
I/O around them).

Rules, for a client given the replicas ``targets`` (``--coord a:50051,b:50051,c:50051``):

1. Calls go to ``current`` (the first target at start; afterwards the last one that led).
2. A standby names the leader (:class:`~sarcomm.common.errors.NotLeaderError` with ``leader``):
   the next call goes there at once, even when that address is not in ``targets`` (it is added),
   unless it was already tried in this round (a stale hint, e.g. a leader that just died).
3. A replica that cannot be reached, or a standby that knows no leader: the next untried target
   of the round, at once.
4. When every target of a round has failed, the next round starts after an exponential backoff
   with jitter (:data:`BACKOFF_FIRST_S` doubling up to :data:`BACKOFF_MAX_S`, each drawn in
   [half, whole]), so that a thousand clients neither hammer a standby nor move in lockstep.
5. A success ends the round and resets the backoff; when it comes from another replica than the
   last one that led, or from the first one to lead after others failed, the client says so in
   one line (:meth:`Failover.succeeded`).

One address is a list of one: every failure ends a round, and the backoff spaces the tries.

The plan is shared by every call of one client (the agent's heartbeat stream and its Leave calls
follow the same leader); a failure reported for a target that is no longer ``current`` (another
call already moved on) only notes why.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["BACKOFF_FIRST_S", "BACKOFF_MAX_S", "Failover", "Miss", "MissKind"]

#: Backoff after the first round in which every replica failed, in seconds; doubles each round.
BACKOFF_FIRST_S = 0.1
#: The longest backoff between rounds, in seconds. A new leader takes over within the leader TTL
#: (a few seconds) and members have ``--reconnect-grace`` (10 s by default) to re-attach: one
#: second between rounds finds it with most of the grace left, at one call per second per client.
BACKOFF_MAX_S = 1.0


class MissKind(enum.Enum):
    """How a try at a replica failed; the value is how a line names it."""

    #: A standby that named the leader.
    STANDBY = "a standby"
    #: A standby that knows no leader.
    STANDBY_NO_LEADER = "a standby that knows no leader"
    #: No connection (it could not be made, or it broke): a probe can find out why.
    UNREACHABLE = "unreachable"
    #: Connected, but the call was answered ``UNAVAILABLE`` or dropped.
    UNAVAILABLE = "unavailable"
    #: Connected, but a stream heard nothing from it for too long.
    SILENT = "silent"


@dataclass(frozen=True)
class Miss:
    """Why a try at a replica failed: its kind and, for people, what was seen."""

    kind: MissKind
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value} ({self.detail})" if self.detail else self.kind.value


class Failover:
    """The failover plan of one client (see the module's rules). Not thread-safe: one event loop.

    ``uniform`` draws the jitter (``random.uniform`` by default; tests pass their own).
    """

    def __init__(
        self, targets: Sequence[str], uniform: Callable[[float, float], float] = random.uniform
    ) -> None:
        if not targets:
            raise ValueError("a failover plan needs at least one target")
        self.targets: list[str] = list(targets)
        self.current: str = self.targets[0]
        self._uniform = uniform
        self._tried: set[str] = set()
        self._rounds = 0
        # Why each target failed since the last success, for the leader-change line and errors.
        self.why: dict[str, Miss] = {}
        self._leader: str | None = None

    @property
    def leader(self) -> str | None:
        """The replica that answered last as leader, or None before any answer."""
        return self._leader

    def not_leader(self, target: str, leader: str) -> float:
        """``target`` answered as a standby naming ``leader`` ("" when it knows none); returns
        the seconds to wait before the next call (at ``current``)."""
        self.why[target] = Miss(MissKind.STANDBY if leader else MissKind.STANDBY_NO_LEADER)
        if target != self.current:
            return 0.0
        self._tried.add(target)
        if leader and leader != target and leader not in self._tried:
            if leader not in self.targets:
                self.targets.append(leader)
            self.current = leader
            return 0.0
        return self._next(target, leader)

    def unreachable(self, target: str, why: Miss = Miss(MissKind.UNREACHABLE)) -> float:
        """``target`` could not be reached, dropped the call or went silent (``why``); returns the
        seconds to wait before the next call (at ``current``)."""
        self.why[target] = why
        if target != self.current:
            return 0.0
        self._tried.add(target)
        return self._next(target, "")

    def succeeded(self, target: str) -> str | None:
        """``target`` answered as leader. Returns the line to log when the client now follows
        another replica than before (None on the first contact with the first target, and while
        the leader stays the same)."""
        line = None
        others = "; ".join(f"{where} is {why}" for where, why in self.why.items() if where != target)
        if target != self._leader and (self._leader is not None or others):
            line = f"following the leader at {target}" + (f" ({others})" if others else "")
        self._leader = target
        self.current = target
        self._tried.clear()
        self._rounds = 0
        self.why.clear()
        return line

    def _next(self, failed: str, hint: str) -> float:
        """Move ``current`` past ``failed``: the next untried target at once, or, when the round
        is over, a new round (from the hinted leader if any) after the backoff."""
        start = self.targets.index(failed) if failed in self.targets else -1
        ordered = self.targets[start + 1 :] + self.targets[: start + 1]
        untried = [t for t in ordered if t not in self._tried]
        if untried:
            self.current = untried[0]
            return 0.0
        self._tried.clear()
        self.current = hint if hint in self.targets else ordered[0]
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(self._rounds, 16))
        self._rounds += 1
        return self._uniform(backoff / 2, backoff)
