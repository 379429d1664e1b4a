"""sarcomm's collectives, start-up and metrics in real gloo groups.

One scenario (every collective, its edge cases and its metrics) runs in real gloo groups of 2, 3
and 4 processes on loopback, once per world size, started through a coordinator; the tests check
the values each rank saw. No test asserts a timing. Without processes: the start-up decisions in
tests/test_comm_startup.py, the helpers and the metrics plumbing in tests/test_collective_helpers.py.
"""

from __future__ import annotations

import functools
import os
import re
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sarcomm.common.errors import InvalidArgumentError, PeerFailedError
from sarcomm.worker.library import collectives, comm, metrics, sar_compat
from sarcomm.worker.library.collectives import torch_ops
from tests.conftest import CoordinatorProcess
from tests.gloo_group import run_gloo
from tests.helpers import wait_for_sd

WORLD_SIZES = (2, 3, 4)
#: float32 elements per all_to_all row: 1 KiB, so that 300 rows (300 KiB) is above the
#: "mixed" mode's small-message threshold (200 KiB) and 100 or 200 rows are at or below it.
ROW = 256


def a2a_rows(src: int, dst: int) -> int:
    """Rows rank ``src`` sends rank ``dst``: 0, 100, 200 or 300, different for most pairs."""
    return (src * 7 + dst * 3 + 1) % 4 * 100


def a2a_block(src: int, dst: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``src`` sends ``dst``: row i holds i + 1000*src + 10*dst (mod 2 for bool)."""
    n = a2a_rows(src, dst)
    values = torch.arange(n, dtype=torch.int64).unsqueeze(1) + 1000 * src + 10 * dst
    values = values.expand(n, ROW)
    return (values % 2).bool() if dtype == torch.bool else values.to(dtype)


# -- the scenario every rank runs (module level: pickled into the spawned processes) ------------


def _delta(op: str, fn: Callable[[], Any]) -> tuple[int, int, int]:
    """(calls, bytes, errors) recorded under ``op`` on gloo while ``fn`` runs."""
    before = metrics.collective_stats(op, "gloo").snapshot()
    fn()
    after = metrics.collective_stats(op, "gloo").snapshot()
    return after.count - before.count, after.bytes_sent - before.bytes_sent, after.errors - before.errors


def _all_to_all_cases(rank: int, world: int) -> dict[str, Any]:
    """Runs all_to_all variants; returns the (case, src) pairs whose data was wrong, and metrics."""
    wrong: list[str] = []
    counts: list[tuple[int, int, int]] = []

    def check(case: str, recv: list[torch.Tensor], dtype: torch.dtype) -> None:
        for src in range(world):
            if recv[src].shape != (a2a_rows(src, rank), ROW) or not torch.equal(
                recv[src], a2a_block(src, rank, dtype)
            ):
                wrong.append(f"{case} from {src}")

    default = collectives.all_to_all_config().small_message_bytes
    # "mixed": 200 KiB threshold, so that 100 and 200 rows are packed and 300 rows go point to point.
    modes = {"default": default, "mixed": 200 * 1024 + 1, "p2p": 0, "packed": 1 << 30}
    for mode, small in modes.items():
        collectives.configure_all_to_all(small_message_bytes=small)
        try:
            for dtype in (torch.float32, torch.int64, torch.bool):
                send = [a2a_block(rank, d, dtype).contiguous() for d in range(world)]
                recv = [torch.zeros(a2a_rows(s, rank), ROW, dtype=dtype) for s in range(world)]
                counts.append(_delta("all_to_all", functools.partial(collectives.all_to_all, recv, send)))
                check(f"{mode}/{dtype}", recv, dtype)
            # Non-contiguous on both sides: transposed views; the receive views must be filled in place.
            send_nc = [a2a_block(rank, d, torch.float32).t().contiguous().t() for d in range(world)]
            bases = [torch.zeros(ROW, a2a_rows(s, rank)) for s in range(world)]
            recv_nc = [base.t() for base in bases]
            collectives.all_to_all(recv_nc, send_nc)
            check(f"{mode}/non-contiguous", [base.t() for base in bases], torch.float32)
            # move_to_comm_device (cpu here) and all-empty messages.
            send = [a2a_block(rank, d, torch.float32) for d in range(world)]
            recv = [torch.zeros(a2a_rows(s, rank), ROW) for s in range(world)]
            collectives.all_to_all(recv, send, move_to_comm_device=True)
            check(f"{mode}/moved", recv, torch.float32)
            empty_recv = [torch.zeros(0, 3) for _ in range(world)]
            collectives.all_to_all(empty_recv, [torch.ones(0, 3) for _ in range(world)])
        finally:
            collectives.configure_all_to_all(small_message_bytes=default)
    expected_bytes = sum(a2a_rows(rank, d) * ROW * 4 for d in range(world) if d != rank)
    return {"wrong": wrong, "counts": counts, "float32_bytes": expected_bytes}


def _errors(rank: int, world: int) -> dict[str, str]:
    messages: dict[str, str] = {}
    floats = [torch.zeros(2) for _ in range(world)]
    doubles = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    mixed = [*floats[:-1], doubles[-1]]
    cases: dict[str, Callable[[], Any]] = {
        "dtype": lambda: collectives.all_to_all(mixed, floats),
        "length": lambda: collectives.all_to_all(floats[:-1], floats),
        "trailing": lambda: collectives.all_to_all([torch.zeros(2, 3) for _ in range(world)], floats),
        "exchange_dtype": lambda: collectives.exchange_tensors(mixed),
    }
    for case, call in cases.items():
        try:
            call()
        except InvalidArgumentError as exc:
            messages[case] = str(exc)
    # A size mismatch between sender and receiver, caught on every rank with check_sizes.
    collectives.configure_all_to_all(check_sizes=True)
    try:
        recv = [torch.zeros(2 + (rank == 1 and src == 0)) for src in range(world)]
        collectives.all_to_all(recv, [torch.zeros(2) for _ in range(world)])
    except InvalidArgumentError as exc:
        messages["check_sizes"] = str(exc)
    finally:
        collectives.configure_all_to_all(check_sizes=False)
    return messages


def _model_helpers(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(rank)
    norm = torch.nn.BatchNorm1d(2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), norm)
    assert norm.running_mean is not None
    norm.running_mean.fill_(float(rank))  # a buffer: synced too, as in SAR
    out["sync_params"] = _delta("sync_params", lambda: collectives.sync_params(model))
    out["state"] = {k: v.tolist() for k, v in model.state_dict().items()}

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.unused = torch.nn.Parameter(torch.zeros(3))  # no gradient on any rank

    for average in (False, True):
        net = Net()
        net.lin.weight.grad = torch.full((2, 2), float(rank + 1))
        net.lin.bias.grad = None if rank == 0 else torch.full((2,), float(rank + 1))  # missing on rank 0
        out[f"gather_grads_{average}"] = _delta(
            "gather_grads", functools.partial(collectives.gather_grads, net, average=average)
        )
        assert net.lin.bias.grad is not None
        out[f"grads_{average}"] = {
            "weight": net.lin.weight.grad.tolist(),
            "bias": net.lin.bias.grad.tolist(),
            "unused": None if net.unused.grad is None else net.unused.grad.tolist(),
        }
    return out


def _scenario(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["getters"] = [
        comm.rank(),
        comm.world_size(),
        comm.backend(),
        str(comm.comm_device()),
        comm.is_initialized(),
    ]

    summed = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    out["all_reduce_delta"] = _delta("all_reduce", lambda: collectives.all_reduce(summed))
    out["all_reduce"] = summed.tolist()
    biggest = torch.tensor([rank], dtype=torch.int64)
    collectives.all_reduce(biggest, dist.ReduceOp.MAX)
    out["all_reduce_max"] = int(biggest.item())
    moved = torch.full((2,), float(rank))
    collectives.all_reduce(moved, move_to_comm_device=True)
    out["all_reduce_moved"] = moved.tolist()
    empty = torch.empty(0, 4)
    collectives.all_reduce(empty)
    out["all_reduce_empty"] = list(empty.shape)
    later = torch.full((3,), float(rank))

    def async_all_reduce() -> None:
        handle = collectives.all_reduce(later, async_op=True)
        assert isinstance(handle, collectives.CollectiveHandle)
        out["async_wait"] = handle.wait()

    out["all_reduce_async_delta"] = _delta("all_reduce", async_all_reduce)
    out["all_reduce_async"] = later.tolist()

    out["all_to_all"] = _all_to_all_cases(rank, world)

    tensors = [
        torch.full((a2a_rows(rank, d) // 100, 3), float(10 * rank + d), dtype=torch.float64)
        for d in range(world)
    ]
    got = collectives.exchange_tensors(tensors)
    given_sizes = collectives.exchange_tensors(
        tensors, recv_sizes=[a2a_rows(s, rank) // 100 for s in range(world)]
    )
    out["exchange"] = [[list(t.shape), t.flatten().tolist(), t.dtype == torch.float64] for t in got]
    out["exchange_given"] = [t.flatten().tolist() for t in given_sizes]

    cast = torch.full((4,), float(rank))
    out["broadcast_delta"] = _delta("broadcast", lambda: collectives.broadcast(cast, src=world - 1))
    out["broadcast"] = cast.tolist()
    cast_async = torch.full((2,), float(rank))
    handle = collectives.broadcast(cast_async, src=0, async_op=True)
    assert handle is not None
    handle.wait()
    out["broadcast_async"] = cast_async.tolist()

    gathered = [torch.zeros(2) for _ in range(world)]
    out["all_gather_delta"] = _delta(
        "all_gather", lambda: collectives.all_gather(gathered, torch.tensor([float(rank), -float(rank)]))
    )
    out["all_gather"] = [t.tolist() for t in gathered]
    gathered_async = [torch.zeros(1) for _ in range(world)]
    handle = collectives.all_gather(gathered_async, torch.tensor([float(rank) * 2]), async_op=True)
    assert handle is not None
    handle.wait()
    out["all_gather_async"] = [t.item() for t in gathered_async]

    inputs = [torch.full((2,), float((rank + 1) * (i + 1))) for i in range(world)]
    scattered = torch.zeros(2)
    out["reduce_scatter_delta"] = _delta(
        "reduce_scatter", lambda: collectives.reduce_scatter(scattered, inputs)
    )
    out["reduce_scatter"] = scattered.tolist()
    # The fallback for backends without reduce_scatter, forced: MAX and async.
    torch_ops._no_native_reduce_scatter.add("gloo")
    try:
        fallback = torch.zeros(2)
        collectives.reduce_scatter(fallback, inputs, dist.ReduceOp.MAX)
        out["reduce_scatter_fallback_max"] = fallback.tolist()
        fallback_sum = torch.zeros(2)
        handle = collectives.reduce_scatter(fallback_sum, inputs, async_op=True)
        assert handle is not None
        handle.wait()
        out["reduce_scatter_fallback_sum"] = fallback_sum.tolist()
    finally:
        torch_ops._no_native_reduce_scatter.discard("gloo")

    reduced = torch.tensor([rank + 1.0])
    out["reduce_delta"] = _delta("reduce", lambda: collectives.reduce(reduced, dst=0))
    out["reduce"] = reduced.item()

    gather_list = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
    out["gather_delta"] = _delta(
        "gather", lambda: collectives.gather(torch.tensor([2.0 * rank]), gather_list, dst=0)
    )
    out["gather"] = [t.item() for t in gather_list] if gather_list is not None else None

    part = torch.zeros(1)
    scatter_list = [torch.tensor([3.0 * i]) for i in range(world)] if rank == 0 else None
    out["scatter_delta"] = _delta("scatter", lambda: collectives.scatter(part, scatter_list, src=0))
    out["scatter"] = part.item()

    # send/recv: rank 0 sends each peer 100+peer; each answers 200+peer, received from any source.
    if rank == 0:
        for peer in range(1, world):
            out.setdefault("send_delta", []).append(
                _delta("send", functools.partial(collectives.send, torch.tensor([100.0 + peer]), dst=peer))
            )
        answers = {}
        for _ in range(1, world):
            box = torch.zeros(1)
            sender = collectives.recv(box)
            answers[sender] = box.item()
        out["answers"] = answers
    else:
        box = torch.zeros(1)

        def receive() -> None:
            out["sender"] = collectives.recv(box, src=0)

        out["recv_delta"] = _delta("recv", receive)
        out["received"] = box.item()
        collectives.send(torch.tensor([200.0 + rank]), dst=0)

    out["barrier_delta"] = _delta("barrier", lambda: collectives.barrier())
    handle = collectives.barrier(async_op=True)
    assert handle is not None
    handle.wait()

    out.update(_model_helpers(rank, world))
    out["exchange_delta"] = _delta("exchange_tensors", lambda: collectives.exchange_tensors(tensors))
    # SAR's exchange_single_tensor, one round of its ring: rank r sends r to r+1 (tests/test_sar_names.py
    # checks it in depth).
    single = torch.zeros(2)
    out["single_delta"] = _delta(
        "exchange_single_tensor",
        lambda: sar_compat.exchange_single_tensor(
            (rank - 1) % world, (rank + 1) % world, single, torch.full((2,), float(rank))
        ),
    )
    out["single"] = single.tolist()

    # An error inside a collective is counted: src outside the world fails on every rank alike.
    def bad_broadcast() -> None:
        try:
            collectives.broadcast(torch.zeros(1), src=world + 5)
        except (ValueError, RuntimeError) as exc:
            out["bad_broadcast"] = type(exc).__name__

    out["broadcast_error_delta"] = _delta("broadcast", bad_broadcast)
    out["errors"] = _errors(rank, world)

    # initialize_comms started this rank's endpoint (a coordinator member: any free port).
    port = metrics.serving_port()
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        out["scrape"] = response.read().decode()
    out["metrics_port"] = port
    out["sd"] = wait_for_sd(os.environ["TEST_COORD_HTTP"], os.environ["SAR_JOB"], world)
    collectives.barrier()  # every rank stays registered until all have seen the full /sd
    out["stats"] = {
        s.op: [s.count, s.bytes_sent, s.errors] for s in metrics.all_stats() if s.backend == "gloo"
    }

    # Last: after a peer failure is recorded, collectives raise it at once.
    comm.mark_peer_failed(
        PeerFailedError("rank 7 on host-x failed: exit code 3", rank=7, reason="exit code 3")
    )
    try:
        collectives.all_reduce(torch.zeros(1))
    except PeerFailedError as exc:
        out["peer_failed"] = [str(exc), exc.rank]
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=[f"world{w}" for w in WORLD_SIZES])
def world(
    request: pytest.FixtureRequest, module_coordinator: CoordinatorProcess
) -> tuple[int, dict[int, dict[str, Any]]]:
    """Every rank's scenario results, started as SAR's examples start: coord_ip_init, then
    initialize_comms with the coordinator's port."""
    size: int = request.param
    job = f"collectives-{size}"
    env = {"TEST_COORD_HTTP": module_coordinator.http_url, "SARCOMM_HEARTBEAT_INTERVAL": "0.25"}
    return size, run_gloo(size, _scenario, env=env, coord=(module_coordinator.grpc_target, job))


def triangle(world_size: int) -> float:
    return world_size * (world_size + 1) / 2


# -- multi-process: values -------------------------------------------------------------------------


def test_getters_report_the_initialised_group(world: tuple[int, dict[int, dict[str, Any]]]) -> None:
    size, results = world
    for rank, r in results.items():
        assert r["getters"] == [rank, size, "gloo", "cpu", True]


def test_all_reduce_sums_in_place_sync_async_moved_and_empty(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    size, results = world
    for r in results.values():
        assert r["all_reduce"] == [triangle(size), 10 * triangle(size)]
        assert r["all_reduce_max"] == size - 1
        assert r["all_reduce_moved"] == [triangle(size - 1)] * 2
        assert r["all_reduce_empty"] == [0, 4]
        assert r["async_wait"] is True
        assert r["all_reduce_async"] == [triangle(size - 1)] * 3


def test_all_to_all_delivers_unequal_zero_row_and_non_contiguous_tensors_on_every_path(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world
    for r in results.values():
        assert r["all_to_all"]["wrong"] == []


def test_exchange_tensors_returns_what_each_peer_sent(world: tuple[int, dict[int, dict[str, Any]]]) -> None:
    _size, results = world
    for rank, r in results.items():
        for src, (shape, values, is_double) in enumerate(r["exchange"]):
            rows = a2a_rows(src, rank) // 100
            assert shape == [rows, 3]
            assert values == [float(10 * src + rank)] * (rows * 3)
            assert is_double
        assert r["exchange_given"] == [values for _, values, _ in r["exchange"]]


def test_broadcast_all_gather_reduce_gather_scatter_values(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    size, results = world
    for rank, r in results.items():
        assert r["broadcast"] == [float(size - 1)] * 4
        assert r["broadcast_async"] == [0.0, 0.0]
        assert r["all_gather"] == [[float(s), -float(s)] for s in range(size)]
        assert r["all_gather_async"] == [2.0 * s for s in range(size)]
        assert r["scatter"] == 3.0 * rank
    assert results[0]["reduce"] == triangle(size)
    assert results[0]["gather"] == [2.0 * s for s in range(size)]


def test_reduce_scatter_native_and_fallback(world: tuple[int, dict[int, dict[str, Any]]]) -> None:
    size, results = world
    for rank, r in results.items():
        assert r["reduce_scatter"] == [(rank + 1) * triangle(size)] * 2
        assert r["reduce_scatter_fallback_sum"] == [(rank + 1) * triangle(size)] * 2
        assert r["reduce_scatter_fallback_max"] == [float(size * (rank + 1))] * 2


def test_send_and_recv_deliver_and_report_the_sender(world: tuple[int, dict[int, dict[str, Any]]]) -> None:
    size, results = world
    assert results[0]["answers"] == {peer: 200.0 + peer for peer in range(1, size)}
    for rank in range(1, size):
        assert (results[rank]["received"], results[rank]["sender"]) == (100.0 + rank, 0)


def test_sync_params_copies_rank_0_parameters_and_buffers(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world
    reference = results[0]["state"]
    assert reference["1.running_mean"] == [0.0, 0.0]
    for r in results.values():
        assert r["state"] == reference


def test_gather_grads_sums_or_averages_and_fills_missing_gradients(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    size, results = world
    for r in results.values():
        total = r["grads_False"]
        assert total["weight"] == [[triangle(size)] * 2] * 2
        assert total["bias"] == [triangle(size) - 1] * 2  # rank 0 had none: counted as zeros
        assert total["unused"] is None  # no rank had one: left None, as without sarcomm
        mean = r["grads_True"]
        assert mean["weight"] == [[pytest.approx(triangle(size) / size)] * 2] * 2
        assert mean["bias"] == [pytest.approx((triangle(size) - 1) / size)] * 2
        assert mean["unused"] is None


# -- multi-process: errors ---------------------------------------------------------------------------


def test_all_to_all_rejects_mismatched_lists_naming_the_field(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    size, results = world
    last = size - 1
    for r in results.values():
        errors = r["errors"]
        assert errors["dtype"] == (
            f"send_list[{last}] has dtype torch.float32 but recv_list[{last}] has dtype torch.float64: "
            f"the tensors exchanged with rank {last} must share a dtype."
        )
        assert (
            errors["length"]
            == f"recv_list has {size - 1} tensors; all_to_all needs one per rank (world size {size})."
        )
        assert errors["trailing"] == (
            "send_list[0] has shape (2,) but recv_list[0] has (2, 3): the tensors exchanged with rank 0 "
            "must share every dimension but the first."
        )
        assert errors["exchange_dtype"] == (
            f"tensors[{last}] has dtype torch.float64 but tensors[0] has torch.float32: "
            "exchange_tensors needs one dtype."
        )


def test_check_sizes_turns_a_size_mismatch_into_an_error_on_every_rank(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world
    assert results[1]["errors"]["check_sizes"] == (
        "recv_list[0] holds 12 bytes but rank 0 sends 8: the receiving tensor must have exactly the size "
        "the peer sends."
    )
    for rank, r in results.items():
        if rank != 1:
            assert re.match(
                r"^all_to_all message sizes do not match on another rank", r["errors"]["check_sizes"]
            )


def test_recorded_peer_failure_is_raised_by_the_next_collective(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world
    for r in results.values():
        assert r["peer_failed"] == ["rank 7 on host-x failed: exit code 3", 7]


# -- multi-process: metrics -----------------------------------------------------------------------------


def test_every_op_records_calls_and_bytes_sent(world: tuple[int, dict[int, dict[str, Any]]]) -> None:
    size, results = world
    for rank, r in results.items():
        assert r["all_reduce_delta"] == (1, 8, 0)
        assert r["all_reduce_async_delta"] == (1, 12, 0)  # recorded by wait()
        float32_case = r["all_to_all"]["counts"][0]
        assert float32_case == (1, r["all_to_all"]["float32_bytes"], 0)
        assert r["broadcast_delta"] == (1, 16 if rank == size - 1 else 0, 0)
        assert r["all_gather_delta"] == (1, 8, 0)
        assert r["reduce_scatter_delta"] == (1, 8 * (size - 1), 0)
        assert r["reduce_delta"] == (1, 0 if rank == 0 else 4, 0)
        assert r["gather_delta"] == (1, 0 if rank == 0 else 4, 0)
        assert r["scatter_delta"] == (1, 4 * (size - 1) if rank == 0 else 0, 0)
        assert r["barrier_delta"] == (1, 0, 0)
        assert r["sync_params"] == (1, sum(4 * n for n in (6, 2, 2, 2, 2, 2)) + 8 if rank == 0 else 0, 0)
        assert r["gather_grads_False"][0] == 1
        assert r["exchange_delta"][0] == 1
        assert (r["single_delta"], r["single"]) == ((1, 8, 0), [float((rank - 1) % size)] * 2)
        assert r["broadcast_error_delta"] == (0, 0, 1)
        if rank == 0:
            assert r["send_delta"] == [(1, 4, 0)] * (size - 1)
        else:
            assert r["recv_delta"] == (1, 0, 0)
        assert set(r["stats"]) == set(comm.OPS)
        assert all(count >= 1 for count, _, _ in r["stats"].values())


def test_metrics_endpoint_serves_the_contract_families(world: tuple[int, dict[int, dict[str, Any]]]) -> None:
    size, results = world
    text = results[0]["scrape"]
    generation = re.search(r'sar_worker_info\{[^}]*generation="(\d+)"', text)
    assert generation is not None
    for line in (
        'sar_collective_duration_seconds_bucket{backend="gloo",le="1e-05",op="all_to_all"}',
        'sar_collective_duration_seconds_bucket{backend="gloo",le="60.0",op="all_reduce"}',
        'sar_collective_duration_seconds_count{backend="gloo",op="barrier"}',
        'sar_collective_bytes_total{backend="gloo",op="all_reduce"}',
        'sar_collective_errors_total{backend="gloo",op="broadcast"} 1.0',
        f'sar_worker_info{{backend="gloo",generation="{generation[1]}",job="collectives-{size}",rank="0",'
        f'world_size="{size}"}} 1.0',
    ):
        assert line in text


def test_every_ranks_metrics_count_its_ops_and_sd_lists_every_rank(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    size, results = world
    for rank, r in results.items():
        counts = {
            m[1]: float(m[2])
            for m in re.finditer(
                r'sar_collective_duration_seconds_count\{backend="gloo",op="(\w+)"\} (\S+)', r["scrape"]
            )
        }
        assert {op: n > 0 for op, n in counts.items()} == {op: True for op in comm.OPS}, rank
        groups = r["sd"]
        assert sorted(int(g["labels"]["rank"]) for g in groups) == list(range(size))
        assert all(g["labels"]["host"] and g["labels"]["job"] == f"collectives-{size}" for g in groups)
        mine = next(g for g in groups if g["labels"]["rank"] == str(rank))
        assert mine["targets"] == [f"127.0.0.1:{r['metrics_port']}"]


def _adopt_a_group_with_a_bad_master_port(rank: int, world_size: int) -> str:
    # As if another library had made the group: initialize_comms takes its port from MASTER_PORT.
    comm.STATE.master_port = 0
    os.environ["MASTER_PORT"] = "port"
    try:
        comm.initialize_comms(rank, world_size, "127.0.0.1", "gloo")
    except InvalidArgumentError as exc:
        return str(exc)
    return "no error"


@pytest.mark.integration  # a gloo rank in a process of its own
def test_initialize_comms_names_a_bad_master_port_of_a_group_it_adopts() -> None:
    # It raised a bare ValueError (int('port')) there, unlike the same variable for a new group.
    assert run_gloo(1, _adopt_a_group_with_a_bad_master_port) == {
        0: "MASTER_PORT='port' is not an integer port in 1..65535."
    }
