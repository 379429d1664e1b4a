"""``sar-worker --world-size MIN:MAX`` end to end: a real coordinator, real agents, real gloo ranks
whose all_reduce values are checked in every generation (tests/scripts/elastic_rank.py).

An elastic world forms at MIN after the last call, re-forms larger when an agent arrives
(scale-up), and re-forms at MIN when an agent and its ranks are SIGKILLed; no restart is counted
for either. The decisions alone: tests/test_agent_elastic_decisions.py; the command line:
tests/test_agent_cli.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CoordinatorProcess
from tests.helpers import wait_for
from tests.test_agent_e2e import AGENT_DEADLINE_S, SCRIPTS, Agents, job_state

pytestmark = pytest.mark.integration

RANK_SCRIPT = str(SCRIPTS / "elastic_rank.py")
# Torch's import and gloo's set-up in every rank of a generation, on a loaded 2-core machine.
WORLD_DEADLINE_S = 90.0
#: Steps each rank of a generation must have run (all values right) before the test moves on.
STEPS = 3


@pytest.fixture
def agents(coordinator: CoordinatorProcess) -> Iterator[Agents]:
    started = Agents(coordinator)
    yield started
    started.kill()


def _records(out: Path) -> list[dict[str, Any]]:
    """Every step every rank wrote so far (a line being written is skipped)."""
    records = []
    for path in out.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _trained(out: Path, world: int, generation: int, agents: set[str]) -> list[dict[str, Any]] | None:
    """The steps of generation ``generation``, once each rank of ``agents`` in a world of ``world``
    ran :data:`STEPS` of them; None before."""
    steps = [r for r in _records(out) if r["generation"] == generation and r["world"] == world and "ok" in r]
    counts: dict[int, int] = {}
    for r in steps:
        counts[r["rank"]] = counts.get(r["rank"], 0) + 1
    ready = len(counts) == world and min(counts.values()) >= STEPS and {r["agent"] for r in steps} == agents
    return steps if ready else None


def _start(agents: Agents, name: str, out: Path, *script_flags: str) -> subprocess.Popen[str]:
    return agents.start(
        name, "elastic", "--world-size", "2:3", "--last-call-timeout", "1", "--backend", "gloo",
        command=[sys.executable, RANK_SCRIPT, str(out), *script_flags],
    )  # fmt: skip


def _finish(agents: Agents, out: Path, procs: list[subprocess.Popen[str]]) -> list[str]:
    """Stop the ranks (the stop file) and wait for every agent to exit 0; their stderr."""
    (out / "stop").touch()
    errs = []
    for proc in procs:
        code, stderr = agents.wait(proc, AGENT_DEADLINE_S)
        assert code == 0, stderr
        errs.append(stderr)
    return errs


def _all_right(out: Path) -> None:
    wrong = [r for r in _records(out) if r.get("ok") is False]
    assert not wrong, wrong[:3]


def test_two_agents_with_two_ranks_each_form_an_elastic_world_at_min_and_finish(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    command = [sys.executable, RANK_SCRIPT, str(tmp_path)]
    flags = ("--world-size", "4:6", "--nproc-per-node", "2", "--last-call-timeout", "1", "--backend", "gloo")
    procs = [agents.start(name, "range", *flags, command=command) for name in ("a", "b")]
    steps = wait_for(
        lambda: _trained(tmp_path, 4, 1, {"a", "b"}),
        WORLD_DEADLINE_S,
        what=lambda: f"a world of 4 ranks training; coordinator:\n{coordinator.log()[-3000:]}",
    )
    by_agent = {name: sorted({r["rank"] for r in steps if r["agent"] == name}) for name in ("a", "b")}
    assert sorted(by_agent.values()) == [[0, 1], [2, 3]]  # each agent's ranks contiguous
    _finish(agents, tmp_path, procs)
    _all_right(tmp_path)
    state = job_state(coordinator, "range")
    assert (state["state"], state["world_size"], state["generation"]) == ("FINISHED", 4, 1)
    assert (state["min_members"], state["max_members"], state["restart_count"]) == (4, 6, 0)


def test_a_third_agent_makes_the_running_agents_re_form_a_larger_world(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    a, b = _start(agents, "a", tmp_path), _start(agents, "b", tmp_path)
    first = wait_for(lambda: _trained(tmp_path, 2, 1, {"a", "b"}), WORLD_DEADLINE_S, what="a world of 2")
    before = {r["agent"]: r["rank"] for r in first}
    c = _start(agents, "c", tmp_path)
    started = time.monotonic()
    second = wait_for(
        lambda: _trained(tmp_path, 3, 2, {"a", "b", "c"}),
        WORLD_DEADLINE_S,
        what=lambda: f"a world of 3 in generation 2; coordinator:\n{coordinator.log()[-3000:]}",
    )
    took = time.monotonic() - started
    print(f"scale-up: a world of 3 trained {STEPS} steps {took:.1f} s after the third agent started")
    after = {r["agent"]: r["rank"] for r in second}
    # The running agents keep their ranks; the newcomer comes after them.
    assert (after["a"], after["b"], after["c"]) == (before["a"], before["b"], 2)
    assert {r["restart_count"] for r in second} == {0}
    errs = _finish(agents, tmp_path, [a, b, c])
    assert "1 rank(s) wait to join; stopping local rank(s)" in errs[0]
    assert "no restart counted" in errs[0]
    _all_right(tmp_path)
    state = job_state(coordinator, "elastic")
    assert (state["state"], state["world_size"], state["generation"]) == ("FINISHED", 3, 2)
    assert (state["restart_count"], state["rerendezvous_count"]) == (0, 1)
    history: list[dict[str, Any]] = state["history"]  # type: ignore[assignment]
    [record] = history
    assert record["state"] == "RESTARTED"
    assert "1 member(s) wait to join" in record["reason"]


def test_sigkill_of_an_agent_and_its_ranks_makes_the_others_re_form_at_min_and_finish(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    a, b, c = (_start(agents, name, tmp_path) for name in ("a", "b", "c"))
    first = wait_for(lambda: _trained(tmp_path, 3, 1, {"a", "b", "c"}), WORLD_DEADLINE_S, what="a world of 3")
    ranks_of_c = {r["pid"] for r in first if r["agent"] == "c"}
    c.send_signal(signal.SIGKILL)
    for pid in ranks_of_c:
        os.kill(pid, signal.SIGKILL)
    lost = time.monotonic()
    second = wait_for(
        lambda: _trained(tmp_path, 2, 2, {"a", "b"}),
        WORLD_DEADLINE_S,
        what=lambda: f"the survivors training in a world of 2; coordinator:\n{coordinator.log()[-3000:]}",
    )
    print(
        f"SIGKILL: the survivors trained {STEPS} steps in a world of 2 {time.monotonic() - lost:.1f} s after"
    )
    assert {r["restart_count"] for r in second} == {0}
    errs = _finish(agents, tmp_path, [a, b])
    for stderr in errs:
        assert "failed: connection lost" in stderr, stderr
        assert "no restart counted" in stderr
    _all_right(tmp_path)
    state = job_state(coordinator, "elastic")
    assert (state["state"], state["world_size"], state["generation"]) == ("FINISHED", 2, 2)
    assert (state["restart_count"], state["rerendezvous_count"]) == (0, 1)
    history: list[dict[str, Any]] = state["history"]  # type: ignore[assignment]
    [record] = history
    assert record["state"] == "RESTARTED"
    assert "connection lost" in record["reason"]


def test_a_rank_that_fails_by_itself_still_fails_an_elastic_job_with_its_exit_code(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    # Rank 1 exits 3; rank 0's collective fails at once (gloo), and its agent holds that exit for
    # the verdict, which is no re-rendezvous: both exits are then reported, and the job fails.
    a, b = (_start(agents, name, tmp_path, "--fail-rank", "1") for name in ("a", "b"))
    codes = {}
    for name, proc in (("a", a), ("b", b)):
        codes[name] = agents.wait(proc, WORLD_DEADLINE_S + 30)
    failed = next(name for name, (code, _) in codes.items() if code == 3)
    other = "b" if failed == "a" else "a"
    assert "rank 1 on host" in codes[failed][1].splitlines()[-1]
    assert "exited with code 3" in codes[failed][1].splitlines()[-1]
    code, stderr = codes[other]
    assert code != 0, stderr
    assert "rank 1 on host" in stderr.splitlines()[-1], stderr
    assert "no restart counted" not in stderr
    state = job_state(coordinator, "elastic")
    assert (state["state"], state["restart_count"], state["rerendezvous_count"]) == ("FAILED", 0, 0)
    assert "rank 1" in str(state["reason"])
    assert "exited with code 3" in str(state["reason"])


def test_an_agent_beyond_max_waits_and_exits_0_when_the_job_finishes_without_it(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    command = [sys.executable, RANK_SCRIPT, str(tmp_path)]
    flags = ("--world-size", "1:2", "--backend", "gloo")
    procs = {name: agents.start(name, "full", *flags, command=command) for name in ("a", "b", "c")}
    # Two of the three form a world of MAX at once; the third waits beyond MAX, uncounted.
    steps = wait_for(
        lambda: next(
            (s for s in [_records(tmp_path)] if {r["rank"] for r in s if r.get("ok")} == {0, 1}), None
        ),
        WORLD_DEADLINE_S,
        what="a world of 2",
    )
    running = {r["agent"] for r in steps}
    [beyond] = set(procs) - running
    errs = dict(
        zip(sorted(running), _finish(agents, tmp_path, [procs[n] for n in sorted(running)]), strict=True)
    )
    code, stderr = agents.wait(procs[beyond])
    assert code == 0, stderr
    assert "this host waited beyond --world-size 1:2 and exits" in stderr
    assert all("waited beyond" not in e for e in errs.values())
    assert not list(tmp_path.glob(f"{beyond}-*.jsonl"))  # its command never ran
    assert job_state(coordinator, "full")["state"] == "FINISHED"
