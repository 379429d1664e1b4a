"""The tiers themselves (tests/tiers.py): which tier a test lands in, and the fast tier's guard.

Each test writes a small test module and runs pytest on it in this process (pytest's
``pytester``), with a conftest that takes the tiers' hooks as tests/conftest.py does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.tiers import PROCESS_FIXTURES, SYSTEM_FIXTURES

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest

from tests.tiers import (  # noqa: F401
    pytest_collection_modifyitems,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    real_processes,
)

@pytest.fixture
def start_coordinator():
    return None

@pytest.fixture
def etcd_cluster():
    return None
"""

MARKERS = """
[tool.pytest.ini_options]
markers = ["fast", "integration", "system", "etcd", "docker", "netns", "prometheus", "slurm", "soak"]
asyncio_default_fixture_loop_scope = "function"
"""


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyprojecttoml(MARKERS)
    return pytester


def tiers(pytester: pytest.Pytester) -> dict[str, str]:
    """Each collected test's name and tier."""
    items, _ = pytester.inline_genitems()
    found: dict[str, str] = {}
    for item in items:
        (tier,) = [m.name for m in item.iter_markers() if m.name in ("fast", "integration", "system")]
        found[item.name] = tier
    return found


def test_the_fixtures_the_tiers_name_exist_in_the_suite() -> None:
    # A renamed fixture would silently drop its tests into the fast tier.
    sources = "\n".join(path.read_text() for path in Path(__file__).parent.glob("*.py"))
    for name in (*PROCESS_FIXTURES, *SYSTEM_FIXTURES):
        assert re.search(rf"@pytest\.fixture.*\n(async )?def {name}\(", sources), name


def test_a_test_lands_in_the_tier_of_what_it_uses_or_says(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_some="""
        import pytest

        @pytest.fixture(scope="module")
        def group(real_processes):
            return 4

        def test_plain():
            pass

        def test_through_a_fixture_that_starts_processes(group):
            pass

        def test_with_a_coordinator(start_coordinator):
            pass

        def test_on_etcd(etcd_cluster):
            pass

        @pytest.mark.docker
        def test_needing_docker():
            pass

        @pytest.mark.integration
        def test_saying_integration():
            pass

        @pytest.mark.parametrize("store", ["sqlite", pytest.param("etcd", marks=pytest.mark.etcd)])
        def test_per_store(store):
            pass
        """
    )
    assert tiers(inner) == {
        "test_plain": "fast",
        "test_through_a_fixture_that_starts_processes": "integration",
        "test_with_a_coordinator": "integration",
        "test_on_etcd": "system",
        "test_needing_docker": "system",
        "test_saying_integration": "integration",
        "test_per_store[sqlite]": "fast",
        "test_per_store[etcd]": "system",
    }


def test_a_module_mark_puts_every_test_of_it_in_that_tier(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_module="""
        import pytest

        pytestmark = pytest.mark.integration

        def test_one():
            pass

        def test_two(etcd_cluster):
            pass
        """
    )
    assert tiers(inner) == {"test_one": "integration", "test_two": "system"}


def test_a_test_marked_fast_that_starts_processes_is_refused_at_collection(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_wrong="""
        import pytest

        @pytest.mark.fast
        def test_claims_fast(start_coordinator):
            pass
        """
    )
    result = inner.runpytest("--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*test_claims_fast is marked fast but uses start_coordinator, which is integration: remove *"]
    )


def test_a_fast_test_that_starts_a_process_fails_naming_it_and_what_to_do(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_spawning="""
        import asyncio
        import multiprocessing
        import subprocess

        import pytest

        def test_runs_a_command():
            subprocess.run(["true"], check=True)

        def test_swallows_the_error():
            try:
                subprocess.run(["true"], check=True)
            except Exception:
                pass

        def test_starts_a_multiprocessing_child():
            child = multiprocessing.get_context("spawn").Process(target=print)
            child.start()

        def test_starts_an_asyncio_subprocess():
            asyncio.run(asyncio.create_subprocess_exec("true"))

        @pytest.fixture(scope="module")
        def helper():
            subprocess.Popen(["sleep", "60"])

        def test_through_a_module_fixture(helper):
            pass

        def test_in_process():
            assert sum([1, 2]) == 3
        """
    )
    result = inner.runpytest("-m", "fast")
    outcomes = result.parseoutcomes()
    # The in-process test and the one that swallowed the error pass their call; each of the others
    # fails there (or in setup, the module fixture), and each of the five fails again at teardown.
    assert (outcomes.get("passed"), outcomes.get("failed"), outcomes.get("errors")) == (2, 3, 6), outcomes
    result.stdout.fnmatch_lines(
        [
            "*ProcessInFastTest: subprocess.Popen(*['true']*): a fast test starts no process: use an "
            "in-process coordinator (tests/coordinator_fixture.py) or mark the test (or its module's "
            "pytestmark) pytest.mark.integration",
        ]
    )
    # Swallowed or not, each attempt fails its test at teardown too.
    result.stdout.fnmatch_lines(["*test_swallows_the_error started a process (subprocess.Popen(*"])
    result.stdout.fnmatch_lines(["*test_starts_a_multiprocessing_child started a process (fork_exec(*"])
    result.stdout.fnmatch_lines(["*test_through_a_module_fixture started a process (subprocess.Popen(*"])
