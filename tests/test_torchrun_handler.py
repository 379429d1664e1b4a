"""sarcomm's torchrun rendezvous handler against torch's contract, in this process: handlers made
through torch's own registry (the ``torchrun.handlers`` entry point), driven as torch's agent drives
them, against a real coordinator. No workers here (tests/test_torchrun.py runs real torchrun)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from sarcomm.common.constants import INTERFACE_VARIABLES
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import free_port, wait_for

#: The variables a handler sets for the workers: restored after every test of this module.
EXPORTED = ("SAR_COORD", "SAR_JOB", "SAR_GENERATION", "SAR_SOCKET_NAME", *INTERFACE_VARIABLES)
#: A refused or unreachable endpoint must be named within this many seconds.
VERDICT_S = 10.0


@pytest.fixture(autouse=True)
def clean_environment() -> Iterator[None]:
    """No exported variable before a test, and the environment as it was after it: a handler
    exports into this process's environment (as into torchrun's agent), and a later test's child
    processes would inherit it (``SAR_SOCKET_NAME=lo`` would pin their nodes to loopback).
    monkeypatch.delenv cannot do this: it forgets a variable that was not set before."""
    saved = dict(os.environ)
    for name in (*EXPORTED, "SARCOMM_TOKEN_FILE"):
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


Make = Callable[..., RendezvousHandler]


@pytest.fixture
def make(module_coordinator: CoordinatorProcess) -> Iterator[Make]:
    """``make(run_id, low, high, endpoint=..., **conf)``: a handler through torch's registry."""
    made: list[RendezvousHandler] = []

    def _make(
        run_id: str, low: int, high: int, endpoint: str | None = None, **conf: Any
    ) -> RendezvousHandler:
        conf.setdefault("last_call_timeout", 1)
        params = RendezvousParameters(
            "sarcomm", endpoint or module_coordinator.grpc_target, run_id, low, high, **conf
        )
        handler = get_rendezvous_handler(params)
        made.append(handler)
        return handler

    yield _make
    for handler in made:
        handler.shutdown()


def rendezvous(*handlers: RendezvousHandler) -> list[RendezvousInfo]:
    """``next_rendezvous()`` of every handler at once, as the nodes' agents call it."""
    with concurrent.futures.ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers))


def job_status(coord: CoordinatorProcess, job: str) -> dict[str, Any]:
    view = coord.get_json("/v1/jobs")
    assert isinstance(view, dict)
    return dict(next(j for j in view["jobs"] if j["job"] == job))


def rpcs(coord: CoordinatorProcess) -> int:
    """Unary and streaming calls the coordinator has handled (heartbeat reports are not calls)."""
    text = coord.get_text("/metrics")
    return sum(int(float(m)) for m in re.findall(r"^sar_coordinator_rpcs_total\{[^}]*\} (\S+)$", text, re.M))


# -- torch's contract -------------------------------------------------------------------------------


def test_registry_makes_sarcomm_handler_from_entry_point(make: Make) -> None:
    handler = make("registry", 1, 2)
    assert type(handler).__name__ == "SarcommRendezvousHandler"
    assert handler.get_backend() == "sarcomm"
    assert handler.get_run_id() == "registry"
    assert handler.use_agent_store
    assert not handler.is_closed()
    assert handler.num_nodes_waiting() == 0
    assert handler.shutdown()


def test_next_rendezvous_forms_world_with_a_shared_store(
    make: Make, module_coordinator: CoordinatorProcess
) -> None:
    a, b = make("pair", 2, 2), make("pair", 2, 2)
    info_a, info_b = rendezvous(a, b)
    assert sorted([info_a.rank, info_b.rank]) == [0, 1]
    assert info_a.world_size == info_b.world_size == 2
    assert info_a.bootstrap_store_info == info_b.bootstrap_store_info
    info_a.store.set("from-a", "hello")
    assert info_b.store.get("from-a") == b"hello"
    # What the workers inherit: the coordinator's interface and job.
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert (os.environ["SAR_JOB"], os.environ["SAR_GENERATION"]) == ("pair", "1")
    assert os.environ["SAR_COORD"] == module_coordinator.grpc_target
    assert a.shutdown()
    assert b.shutdown()
    assert job_status(module_coordinator, "pair")["state"] == "FINISHED"


def test_num_nodes_waiting_turns_positive_without_a_call_if_node_parks(
    make: Make, module_coordinator: CoordinatorProcess
) -> None:
    a, b = make("grow", 2, 3), make("grow", 2, 3)
    info_a, _ = rendezvous(a, b)
    before = rpcs(module_coordinator)
    assert all(h.num_nodes_waiting() == 0 for _ in range(1000) for h in (a, b))
    assert rpcs(module_coordinator) == before  # answered from the heartbeat stream
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        late = make("grow", 2, 3)
        parked = pool.submit(late.next_rendezvous)
        wait_for(lambda: a.num_nodes_waiting() == b.num_nodes_waiting() == 1, 30, what="1 node waiting")
        again_a, again_b = rendezvous(a, b)  # the agents re-rendezvous
        info_late = parked.result(30)
    assert (again_a.rank, again_b.rank, info_late.rank) == (info_a.rank, 1 - info_a.rank, 2)
    assert {again_a.world_size, again_b.world_size, info_late.world_size} == {3}
    assert a.num_nodes_waiting() == 0
    status = job_status(module_coordinator, "grow")
    assert (status["generation"], status["restart_count"], status["rerendezvous_count"]) == (2, 0, 1)
    # Counted apart from failures and restarts.
    metrics = module_coordinator.get_text("/metrics")
    assert re.search(r"^sar_coordinator_rerendezvous_total [1-9]", metrics, re.M)


def test_set_closed_closes_rendezvous_for_every_node(make: Make) -> None:
    a, b = make("close", 2, 3), make("close", 2, 3)
    rendezvous(a, b)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        parked = pool.submit(make("close", 2, 3).next_rendezvous)
        wait_for(lambda: a.num_nodes_waiting() == 1, 30, what="the third node to wait")
        a.set_closed()  # type: ignore[no-untyped-call]  # torch leaves its signature untyped
        assert a.is_closed()
        wait_for(b.is_closed, 10, what="the other node to hear of the close")
        with pytest.raises(
            RendezvousClosedError, match=r"^job close: the rendezvous of job 'close' generation 1 "
        ):
            parked.result(30)
    with pytest.raises(RendezvousClosedError, match=r"is closed \(rank \d on host .* closed it\)"):
        b.next_rendezvous()


def test_node_beyond_max_exits_gracefully_if_rendezvous_closes(
    make: Make, module_coordinator: CoordinatorProcess
) -> None:
    a, b = make("full", 1, 2), make("full", 1, 2)
    rendezvous(a, b)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        parked = pool.submit(make("full", 1, 2).next_rendezvous)
        wait_for(
            lambda: job_status(module_coordinator, "full")["parked_members"] == 1, 30, what="a parked node"
        )
        assert a.num_nodes_waiting() == 0  # beyond MAX: not counted
        assert a.shutdown()  # a node that finished closes the rendezvous (as torch's backends do)
        with pytest.raises(RendezvousGracefulExitError, match=r"is closed \(rank \d on host .* finished\)"):
            parked.result(60)


def test_shutdown_reports_failed_workers_exit_code_and_others_hear_it(
    make: Make, module_coordinator: CoordinatorProcess
) -> None:
    a, b = make("fails", 2, 2), make("fails", 2, 2)
    info_a, _ = rendezvous(a, b)
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=3, error_file="")
    try:
        raise ChildFailedError("train.py", {2 * info_a.rank + 1: failure})
    except ChildFailedError:
        assert a.shutdown()  # as torch's launcher calls it while the error propagates
    wait_for(lambda: b.num_nodes_waiting() > 0, 10, what="the other node to hear of the failure")
    with pytest.raises(RendezvousClosedError, match=r"worker \(global rank \d\) exited with code 3"):
        b.next_rendezvous()
    status = job_status(module_coordinator, "fails")
    assert status["state"] == "FAILED"
    assert "exited with code 3" in status["reason"]


# -- bad input: one clear error each, in seconds ------------------------------------------------------


def test_next_rendezvous_raises_connection_error_if_nothing_listens(make: Make) -> None:
    port = free_port()
    handler = make("nobody", 1, 1, endpoint=f"127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as raised:
        handler.next_rendezvous()
    assert time.monotonic() - started < VERDICT_S
    assert str(raised.value).startswith("job nobody: ")
    assert f"127.0.0.1:{port}" in str(raised.value)
    print(f"\nnothing listening: {raised.value}")


def test_next_rendezvous_raises_connection_error_if_token_is_wrong(
    start_coordinator: StartCoordinator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "right").write_text("right-token\n")
    (tmp_path / "wrong").write_text("wrong-token\n")
    coord = start_coordinator("--token-file", str(tmp_path / "right"))
    monkeypatch.setenv("SARCOMM_TOKEN_FILE", str(tmp_path / "wrong"))
    handler = get_rendezvous_handler(RendezvousParameters("sarcomm", coord.grpc_target, "token", 1, 1))
    started = time.monotonic()
    try:
        with pytest.raises(RendezvousConnectionError, match=r"token") as raised:
            handler.next_rendezvous()
    finally:
        handler.shutdown()
    assert time.monotonic() - started < VERDICT_S
    print(f"\nwrong token: {raised.value}")


@pytest.mark.parametrize(
    ("run_id", "low", "high", "conf", "message"),
    [
        (
            "a b",
            1,
            1,
            {},
            r"--rdzv-id 'a b' must be 1 to 128 letters, digits, '\.', '_' or '-', starting with ",
        ),
        ("ok", 1, 1, {"join_timeout": "soon"}, r"--rdzv-conf join_timeout='soon' must be a positive number "),
        ("ok", 1, 1, {"last_call_timeout": "-1"}, r"--rdzv-conf last_call_timeout='-1' must be a number of "),
    ],
    ids=["rdzv-id", "join_timeout", "last_call_timeout"],
)
def test_handler_raises_value_error_if_setting_is_malformed(
    module_coordinator: CoordinatorProcess,
    run_id: str,
    low: int,
    high: int,
    conf: dict[str, str],
    message: str,
) -> None:
    params = RendezvousParameters("sarcomm", module_coordinator.grpc_target, run_id, low, high, **conf)
    with pytest.raises(ValueError, match=r"^sarcomm rendezvous: " + message):
        get_rendezvous_handler(params)


def test_parameters_raise_value_error_if_min_exceeds_max(module_coordinator: CoordinatorProcess) -> None:
    # torchrun's --nnodes 3:2 never reaches a backend: torch's own parameters refuse it, clearly.
    with pytest.raises(
        ValueError, match=r"^The maximum number of rendezvous nodes \(2\) must be greater than "
    ):
        RendezvousParameters("sarcomm", module_coordinator.grpc_target, "x", 3, 2)
