"""A two-rank ``sar-worker`` job that goes on across a move of its coordinator (a take-over on
etcd, or a coordinator restarted at another address on the same state), for the failover tests.

Its ranks (``tests/scripts/agent_rank.py failover``) run one all_reduce, write ``rankN.before``,
wait for the file ``go`` and then finish their collectives; :func:`check_ranks` checks each value.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.messages import Assignment, MemberReport
from tests.helpers import SAR_WORKER, wait_for

#: Bounds every wait of a failover test on a coordinator (a call, an answer, a stream's next event).
DEADLINE_S = 20.0
#: Bounds an agent's whole job (start, join, the ranks' collectives, exit).
AGENT_DEADLINE_S = 120.0
RANK_SCRIPT = str(Path(__file__).parent / "scripts" / "agent_rank.py")


@dataclass
class AgentJob:
    agent: subprocess.Popen[bytes]
    out: Path
    log: Path
    coord: str

    def log_text(self) -> str:
        return self.log.read_text()

    def finish(self) -> None:
        """Let the ranks run their last collectives; the agent must exit 0."""
        (self.out / "go").write_text("")
        code = self.agent.wait(AGENT_DEADLINE_S)
        assert code == 0, self.log_text()

    def check_ranks(self) -> None:
        """Every rank got the whole coordinator list and computed every value right."""
        for rank in (0, 1):
            seen = json.loads((self.out / f"rank{rank}.json").read_text())
            assert seen["coord"] == self.coord  # the ranks got the whole list
            assert seen["before"] == [3.0]
            assert seen["all_reduce"] == [3.0, 30.0]
            assert seen["all_to_all"] == [[float(100 * src + rank)] * (src + rank + 1) for src in range(2)]


@contextlib.contextmanager
def agent_job(coord: str, job: str, tmp_path: Path) -> Iterator[AgentJob]:
    """Start the agent with ``--coord coord``; yield once both ranks are past their first
    all_reduce; the agent is killed on the way out if it still runs."""
    out = tmp_path / "ranks"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    log = tmp_path / "agent.log"
    with log.open("wb") as log_file:
        agent = subprocess.Popen(
            [*SAR_WORKER, "--coord", coord, "--job", job,
             "--world-size", "2", "--nproc-per-node", "2", "--backend", "gloo",
             "--heartbeat-interval", "0.25", "--join-timeout", "60",
             "--", sys.executable, RANK_SCRIPT, "failover", str(out)],
            stdout=log_file, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    running = AgentJob(agent, out, log, coord)
    try:
        wait_for(
            lambda: all((out / f"rank{r}.before").exists() for r in (0, 1)),
            AGENT_DEADLINE_S,
            what=lambda: f"both ranks past their first all_reduce; agent:\n{running.log_text()}",
        )
        yield running
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)


@contextlib.asynccontextmanager
async def answering(client: CoordinatorClient, member: Assignment) -> AsyncIterator[list[str]]:
    """Heartbeat ``member`` every 0.25 s through ``client``; yields the list of the replicas
    (``client.target`` at the time) that answered each report, in order."""
    answered_by: list[str] = []

    def reports() -> list[MemberReport]:
        return [MemberReport(member.member_id, member.secret)]

    async with client.heartbeats(reports, 0.25) as stream:

        async def read() -> None:
            async for _ in stream:
                answered_by.append(client.target)

        reader = asyncio.ensure_future(read())
        try:
            yield answered_by
        finally:
            reader.cancel()
