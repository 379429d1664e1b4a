"""The suite's three tiers, given to every test at collection, and the fast tier's one rule.

- ``fast``: in-process and unit tests. No process is started: no ``sar-coordinator`` or
  ``sar-worker`` child, no gloo ranks, no tool. ``bash scripts/test-fast.sh`` runs them (well under
  a minute); the default for a test that says nothing.
- ``integration``: real processes on this machine (coordinators, agents, gloo ranks, the command
  lines, a wheel's venv).
- ``system``: the tools: Docker, etcd, Prometheus, Slurm, network namespaces, the soak.

A test's tier is the highest of what it says (a ``pytest.mark.integration`` or ``system`` on the
test or its module's ``pytestmark``) and what it uses: a tool marker (:data:`SYSTEM_TOOLS`) or a
fixture that starts a tool (:data:`SYSTEM_FIXTURES`: etcd, Slurm; it adds the tool's marker) makes
it ``system``; a fixture that starts a process (:data:`PROCESS_FIXTURES`, including any fixture
that asks for :func:`real_processes`) makes it ``integration``. A test marked ``fast`` that uses
either is refused at collection.

A fast test that starts a process anyway (``subprocess``, ``asyncio``'s subprocesses,
``multiprocessing``, ``os.fork``) in its setup or its body fails at that call and again at
teardown (in case the code under test swallowed the error), naming what it started and what to do
(:func:`pytest_runtest_setup` and :func:`pytest_runtest_teardown`). The guard covers the module-
and session-scoped fixtures a fast test sets up, so run the fast tier on its own, as
``scripts/test-fast.sh`` does, to check it. So a new test lands in the fast tier by default and
cannot stay there by mistake.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

FAST, INTEGRATION, SYSTEM = "fast", "integration", "system"
#: The tiers, lowest first.
TIERS = (FAST, INTEGRATION, SYSTEM)
#: Markers that name a tool a test needs; each puts the test in the system tier.
SYSTEM_TOOLS = frozenset({"docker", "etcd", "netns", "prometheus", "slurm", "soak"})
#: Fixtures that start a tool, with the tool marker each adds: their tests are in the system tier.
SYSTEM_FIXTURES = {"etcd_cluster": "etcd", "module_etcd_cluster": "etcd", "slurm": "slurm"}
#: Fixtures that start processes: conftest.py's coordinators, and :func:`real_processes`, which a
#: fixture of a test module asks for to say that it starts some (a gloo group, agents, a venv).
#: Their tests are integration tests.
PROCESS_FIXTURES = frozenset({"start_coordinator", "coordinator", "module_coordinator", "real_processes"})

#: What a fast test is told when it starts a process.
_ADVICE = (
    "a fast test starts no process: use an in-process coordinator (tests/coordinator_fixture.py) or "
    "mark the test (or its module's pytestmark) pytest.mark.integration"
)


class ProcessInFastTest(RuntimeError):
    """Raised when a test of the fast tier starts a process."""


@pytest.fixture(scope="session")
def real_processes() -> None:
    """Asked for by a fixture that starts processes, to put every test that uses it (directly or
    through other fixtures) in the integration tier: ``def world(real_processes: None) -> ...``.
    Does nothing itself."""


def _tier_of(item: pytest.Item) -> str:
    """The test's tier, after adding the tool markers its fixtures imply (see the module doc)."""
    fixtures = set(getattr(item, "fixturenames", ()))
    for fixture, tool in SYSTEM_FIXTURES.items():
        if fixture in fixtures and item.get_closest_marker(tool) is None:
            item.add_marker(tool)
    said = {m.name for m in item.iter_markers() if m.name in TIERS}
    if any(item.get_closest_marker(tool) for tool in SYSTEM_TOOLS):
        used = SYSTEM
    elif fixtures & PROCESS_FIXTURES:
        used = INTEGRATION
    else:
        used = FAST
    if FAST in said and used != FAST:
        why = sorted(fixtures & (PROCESS_FIXTURES | SYSTEM_FIXTURES.keys())) or sorted(
            tool for tool in SYSTEM_TOOLS if item.get_closest_marker(tool)
        )
        raise pytest.UsageError(
            f"{item.nodeid} is marked fast but uses {', '.join(why)}, which is {used}: "
            f"remove pytest.mark.fast (a fast test starts no process and needs no tool)"
        )
    return max([used, *said], key=TIERS.index)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every collected test its one tier marker (before ``-m`` selects on it): the tier marks
    said on tests, classes and modules are replaced by the tier each test ends up in, so that a
    module marked ``integration`` whose test needs etcd has that test in ``system`` only."""
    tiers = [(item, _tier_of(item)) for item in items]
    for item in items:
        for node in item.listchain():
            node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]
    for item, tier in tiers:
        item.add_marker(tier)


def _refusing(what: str, started: list[str]) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        shown = f"{what}({', '.join(repr(a)[:200] for a in args[:2])})"
        started.append(shown)
        raise ProcessInFastTest(f"{shown}: {_ADVICE}")

    return refuse


#: A fast test's guard while it runs: the patches and what the test tried to start.
_GUARD = pytest.StashKey[tuple[pytest.MonkeyPatch, list[str]]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """In a fast test, from its setup on (fixtures of every scope it sets up included), every way
    of starting a process raises :class:`ProcessInFastTest`."""
    if item.get_closest_marker(FAST) is not None:
        patch, started = pytest.MonkeyPatch(), list[str]()
        # Popen covers subprocess.run and friends and asyncio's subprocesses; fork_exec is what
        # multiprocessing's spawn and forkserver call; os.fork what its fork context calls.
        patch.setattr(subprocess.Popen, "_execute_child", _refusing("subprocess.Popen", started))
        patch.setattr(_posixsubprocess, "fork_exec", _refusing("fork_exec", started))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                patch.setattr(os, name, _refusing(f"os.{name}", started))
        item.stash[_GUARD] = (patch, started)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Lift the guard before the teardown (which may end a module's fixtures, a tool's cleanup
    among them); then fail the test if it started a process, even one whose error the code under
    test caught."""
    guard = item.stash.get(_GUARD, None)
    if guard is not None:
        guard[0].undo()
    result = yield
    if guard is not None and guard[1]:
        pytest.fail(f"{item.nodeid} started a process ({'; '.join(guard[1])}): {_ADVICE}")
    return result
