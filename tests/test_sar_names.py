"""SAR's comm names and keywords in sarcomm: ``exchange_single_tensor``, ``CommThread`` and
``comm_thread``, ``master_ip``/``master_port``, ``nfs_ip_init``, SAR's keyword names of
``initialize_comms``/``all_to_all``/``all_reduce``, and ``gather_grads(bucketed=False)`` (SAR's
order).

The multi-process test runs one scenario in real gloo groups of 2, 3 and 4 processes on loopback
and checks the values every rank saw; the single-process tests pin argument handling and the comm
thread's queueing, which need no group.
"""

from __future__ import annotations

import functools
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import sarcomm.worker as sar
from sarcomm.common.errors import FailedPreconditionError, InvalidArgumentError
from sarcomm.worker.library import collectives, comm, metrics, sar_keywords
from sarcomm.worker.library.task_thread import CommThread
from tests.gloo_group import run_gloo
from tests.helpers import free_port

WORLD_SIZES = (2, 3, 4)
COLS = 3


def rows(src: int, dst: int) -> int:
    """Rows ``src`` sends ``dst`` in the exchange rounds: 0 to 4, 0 for some pairs."""
    return (src * 3 + dst * 2) % 5


def block(src: int, dst: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = rows(src, dst)
    return (torch.arange(n * COLS, dtype=torch.int64).reshape(n, COLS) + 100 * src + 10 * dst).to(dtype)


def _calls(op: str) -> tuple[int, int]:
    snap = metrics.collective_stats(op, "gloo").snapshot()
    return snap.count, snap.bytes_sent


# -- the scenario every rank runs (module level: pickled into the spawned processes) ------------


def _exchange_rounds(rank: int, world: int) -> dict[str, Any]:
    """SAR's aggregation pattern: in round k, send to rank+k and receive from rank-k."""
    wrong: list[str] = []
    before = _calls("exchange_single_tensor")
    for k in range(world):
        send_idx, recv_idx = (rank + k) % world, (rank - k) % world
        dtype = torch.int64 if k % 2 else torch.float32
        recv = torch.full((rows(recv_idx, rank), COLS), -1, dtype=dtype)
        sar.exchange_single_tensor(recv_idx, send_idx, recv, block(rank, send_idx, dtype))
        if not torch.equal(recv, block(recv_idx, rank, dtype)):
            wrong.append(f"round {k} from {recv_idx}")
    after = _calls("exchange_single_tensor")
    # A non-contiguous receiving view, filled in place.
    if world > 1:
        send_idx, recv_idx = (rank + 1) % world, (rank - 1) % world
        base = torch.zeros(COLS, rows(recv_idx, rank))
        sar.exchange_single_tensor(recv_idx, send_idx, base.t(), block(rank, send_idx))
        if not torch.equal(base.t(), block(recv_idx, rank)):
            wrong.append("non-contiguous")
    sent = sum(
        block(rank, (rank + k) % world, torch.int64 if k % 2 else torch.float32).nbytes
        for k in range(1, world)
    )
    return {"wrong": wrong, "calls": after[0] - before[0], "bytes": after[1] - before[1], "sent": sent}


def _exchange_errors(rank: int, world: int) -> dict[str, str]:
    found: dict[str, str] = {}
    t = torch.zeros(1, COLS)
    cases: dict[str, Callable[[], None]] = {
        "range": lambda: sar.exchange_single_tensor(world, rank, t, t),
        "self_one_side": lambda: sar.exchange_single_tensor(rank, (rank + 1) % world, t, t),
        "dtype": lambda: sar.exchange_single_tensor(rank, rank, t, t.long()),
    }
    for case, call in cases.items():
        try:
            call()
        except InvalidArgumentError as exc:
            found[case] = str(exc)
    return found


def _fetch(k: int, rank: int, world: int) -> tuple[int, torch.Tensor]:
    """One of SAR's prefetch tasks: round k's features, as (recv_idx, tensor)."""
    send_idx, recv_idx = (rank + k) % world, (rank - k) % world
    recv = torch.empty(rows(recv_idx, rank), COLS)
    sar.exchange_single_tensor(recv_idx, send_idx, recv, block(rank, send_idx))
    return recv_idx, recv


def _comm_thread_pipeline(rank: int, world: int) -> list[str]:
    """SAR's pipelined aggregation: prefetch rounds on the comm thread, read results in order."""
    wrong: list[str] = []
    depth = 1
    submitted = 0
    for k in range(world):
        while submitted <= k + depth and submitted < world:
            sar.comm_thread.submit_task(
                f"round {submitted}", functools.partial(_fetch, submitted, rank, world)
            )
            submitted += 1
        recv_idx, got = sar.comm_thread.get_result()
        if recv_idx != (rank - k) % world or not torch.equal(got, block(recv_idx, rank)):
            wrong.append(f"round {k}")
    return wrong


def _keywords(rank: int, world: int) -> dict[str, Any]:
    wrong: list[str] = []
    send = [block(rank, d) for d in range(world)]
    recv = [torch.empty(rows(s, rank), COLS) for s in range(world)]
    sar.all_to_all(recv_tensors=recv, send_tensors=send, move_to_comm_device=True)
    if any(not torch.equal(recv[s], block(s, rank)) for s in range(world)):
        wrong.append("all_to_all(recv_tensors=, send_tensors=)")
    recv = [torch.empty(rows(s, rank), COLS) for s in range(world)]
    sar.all_to_all(recv, send_tensors=send)  # one of each spelling
    if any(not torch.equal(recv[s], block(s, rank)) for s in range(world)):
        wrong.append("all_to_all(recv, send_tensors=)")
    t = torch.full((2,), float(rank + 1))
    # As SAR's examples call it: through ``sar.comm``.
    sar.comm.all_reduce(red_tensor=t, op=torch.distributed.ReduceOp.SUM, move_to_comm_device=True)
    if t.tolist() != [world * (world + 1) / 2] * 2:
        wrong.append(f"all_reduce(red_tensor=) gave {t.tolist()}")
    errors = []
    calls: tuple[Callable[[], object], ...] = (
        lambda: sar.all_to_all(recv, send, recv_tensors=recv),
        lambda: sar.all_reduce(t, red_tensor=t),
    )
    for call in calls:
        try:
            call()
        except TypeError as exc:
            errors.append(str(exc))
    return {"wrong": wrong, "errors": errors}


def _gather_grads_sar_order(rank: int, world: int) -> dict[str, Any]:
    """gather_grads(bucketed=False) against one all_reduce per gradient, bit for bit."""
    torch.manual_seed(1234 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 7), torch.nn.Linear(7, 1))
    for param in model.parameters():
        # Magnitudes spread over many binades, so that the order of the additions shows in the bits.
        param.grad = torch.randn_like(param) * torch.exp(torch.randn_like(param) * 6)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    expected = [g.clone() for g in grads]
    for g in expected:
        collectives.all_reduce(g)
    calls = _calls("gather_grads")
    reduces = _calls("all_reduce")
    sar.gather_grads(model, bucketed=False)
    got = [p.grad for p in model.parameters()]
    equal = all(g is not None and torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    averaged = torch.nn.Linear(3, 2)
    for param in averaged.parameters():
        param.grad = torch.full_like(param, float(rank + 1))
    sar.gather_grads(averaged, average=True, bucketed=False)
    mean = (world + 1) / 2
    average_ok = all(
        torch.equal(p.grad, torch.full_like(p, mean)) for p in averaged.parameters() if p.grad is not None
    )
    return {
        "equal": equal,
        "average_ok": average_ok,
        "gather_calls": _calls("gather_grads")[0] - calls[0],
        # gather_grads runs its collectives inside one recorded call: no all_reduce of its own.
        "all_reduce_calls": _calls("all_reduce")[0] - reduces[0],
    }


def _reinit_with_sar_keywords(rank: int, world: int) -> float:
    comm.destroy_comms()
    sar.initialize_comms(
        _rank=rank,
        _world_size=world,
        master_ip_address="127.0.0.1",
        backend="gloo",
        _comm_device=None,
        master_port_number=int(os.environ["TEST_SECOND_PORT"]),
    )
    t = torch.ones(1)
    sar.all_reduce(t)
    return float(t.item())


def scenario(rank: int, world: int) -> dict[str, Any]:
    return {
        "master": (sar.master_ip(), sar.master_port(), os.environ["MASTER_PORT"]),
        "exchange": _exchange_rounds(rank, world),
        "exchange_errors": _exchange_errors(rank, world),
        "pipeline": _comm_thread_pipeline(rank, world),
        "keywords": _keywords(rank, world),
        "gather": _gather_grads_sar_order(rank, world),
        "reinit": _reinit_with_sar_keywords(rank, world),
    }


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world_results(
    request: pytest.FixtureRequest, real_processes: None
) -> tuple[int, dict[int, dict[str, Any]]]:
    world = int(request.param)
    return world, run_gloo(world, scenario, env={"TEST_SECOND_PORT": str(free_port())})


def test_master_ip_and_port_are_the_ones_initialize_comms_used(
    world_results: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world_results
    seen = {r["master"] for r in results.values()}
    assert len(seen) == 1
    ip, port, env_port = seen.pop()
    assert (ip, port) == ("127.0.0.1", int(env_port))


def test_exchange_single_tensor_moves_each_rounds_tensors(
    world_results: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    world, results = world_results
    for rank, r in results.items():
        ex = r["exchange"]
        assert ex["wrong"] == [], f"rank {rank}"
        # One recorded call per round (round 0 is the local copy), bytes of what went to others.
        assert (ex["calls"], ex["bytes"]) == (world, ex["sent"])


def test_exchange_single_tensor_rejects_bad_indices_and_dtypes(
    world_results: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    world, results = world_results
    errors = results[0]["exchange_errors"]
    assert errors["range"] == f"recv_idx={world} must be a rank in 0..{world - 1} (world size {world})."
    assert errors["self_one_side"] == (
        "recv_idx=0 and send_idx=1 on rank 0: either both are this rank (a local copy) or neither is "
        "(an exchange with two peers)."
    )
    assert errors["dtype"].startswith("send_tensor has dtype torch.int64 but recv_tensor has torch.float32")


def test_comm_thread_runs_sars_prefetch_pipeline(
    world_results: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world_results
    assert {rank: r["pipeline"] for rank, r in results.items()} == {rank: [] for rank in results}


def test_sar_keyword_names_are_accepted_and_both_spellings_refused(
    world_results: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    world, results = world_results
    for rank, r in results.items():
        assert r["keywords"]["wrong"] == [], f"rank {rank}"
        same = "SAR's name for the same argument: pass one of them."
        assert r["keywords"]["errors"] == [
            f"all_to_all() got both 'recv_list' and 'recv_tensors', {same}",
            f"all_reduce() got both 'tensor' and 'red_tensor', {same}",
        ]
        assert r["reinit"] == float(world)


def test_gather_grads_in_sars_order_equals_one_all_reduce_per_parameter(
    world_results: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world_results
    for rank, r in results.items():
        g = r["gather"]
        assert (g["equal"], g["average_ok"], g["gather_calls"], g["all_reduce_calls"]) == (
            True,
            True,
            2,
            0,
        ), rank


# -- single process --------------------------------------------------------------------------------


def test_initialize_comms_refuses_both_spellings_and_a_missing_rank() -> None:
    with pytest.raises(TypeError, match=r"^initialize_comms\(\) got both 'rank' and '_rank'"):
        sar.initialize_comms(0, 1, "127.0.0.1", "gloo", _rank=0)
    with pytest.raises(TypeError, match=r"^initialize_comms\(\) got both 'comm_device' and '_comm_device'"):
        sar.initialize_comms(0, 1, "127.0.0.1", "gloo", "cpu", _comm_device="cpu")
    with pytest.raises(
        TypeError,
        match=r"^initialize_comms\(\) missing required argument 'world_size' "
        r"\(SAR's name: '_world_size'\)\.$",
    ):
        sar.initialize_comms(_rank=0, master_ip_address="127.0.0.1", backend="gloo")
    with pytest.raises(TypeError, match=r"^initialize_comms\(\) missing required argument 'backend'\.$"):
        sar.initialize_comms(0, 1, "127.0.0.1")
    with pytest.raises(TypeError, match=r"^all_to_all\(\) missing required argument 'send_list'"):
        sar.all_to_all(recv_tensors=[])
    assert not comm.is_initialized()


def test_nfs_ip_init_explains_the_move_outside_a_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delenv("SAR_MEMBER_ID", raising=False)
    ip_file = tmp_path / "ip_file"
    with pytest.raises(FailedPreconditionError, match=r"sar\.coord_ip_init\(rank, 'HEAD:50051', job='NAME'"):
        sar.nfs_ip_init(0, str(ip_file))
    assert not ip_file.exists()


def test_nfs_ip_init_returns_the_master_address_of_a_member(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAR_MEMBER_ID", "m1")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("RANK", "2")
    assert sar.nfs_ip_init(2, "/nonexistent/ip_file") == "10.1.2.3"
    with pytest.raises(
        InvalidArgumentError, match=r"^nfs_ip_init\(_rank=1, \.\.\.\) but this process is rank 2"
    ):
        sar.nfs_ip_init(1, "/nonexistent/ip_file")


def test_finalize_without_a_job_does_nothing_every_time() -> None:
    sar.finalize()
    sar.finalize()
    assert not sar.is_initialized()


@pytest.mark.integration  # a fresh interpreter
def test_sars_comm_names_resolve_through_sar_comm_in_a_fresh_process() -> None:
    names = sorted(sar_keywords.SAR_COMM_NAMES_ELSEWHERE)
    code = (
        "import sarcomm.worker as sar\n"
        f"for name in {names!r}:\n"
        "    assert getattr(sar.comm, name) is getattr(sar, name), name\n"
        "assert sar.comm.rank is sar.rank and sar.comm.master_port is sar.master_port\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr


def test_comm_thread_keeps_order_skips_none_and_hands_over_exceptions() -> None:
    thread = CommThread()
    try:
        order: list[int] = []
        gate = threading.Event()

        def first() -> int:
            gate.wait(10)
            order.append(1)
            return 1

        def broken() -> None:
            raise ValueError("task broke")

        thread.submit_task("a", first)
        thread.submit_task(task_id="b", task=lambda: order.append(2))  # returns None: not queued
        thread.submit_task("c", broken)
        thread.submit_task("d", lambda: 4)
        with pytest.raises(queue.Empty):
            thread.get_result(block=False)
        gate.set()
        assert thread.get_result(timeout=10) == 1
        with pytest.raises(ValueError, match=r"^task broke$"):
            thread.get_result(timeout=10)
        assert thread.get_result(timeout=10) == 4  # the thread survived the exception
        assert order == [1, 2]
        with pytest.raises(TypeError, match=r"^task 'x' is a int, not a callable with no arguments\.$"):
            thread.submit_task("x", 5)  # type: ignore[arg-type]
    finally:
        thread.stop()
    thread.submit_task("after stop", lambda: "again")  # a later submit starts a new thread
    try:
        assert thread.get_result(timeout=10) == "again"
    finally:
        thread.stop()
