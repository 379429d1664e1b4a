"""The collectives' pure helpers and the metrics plumbing, in one process: gradient buckets, the
fallback reduction, ``configure_all_to_all``, the duration histogram, the exposition and the
metrics server. The collectives in real gloo groups: tests/test_collectives.py.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.library import collectives, metrics
from sarcomm.worker.library.collectives import model_sync, torch_ops


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from([torch.float32, torch.float64])), max_size=20
    ),
    cap=st.integers(1, 200),
)
def test_buckets_keep_order_per_dtype_and_stay_under_the_cap(
    sizes: list[tuple[int, torch.dtype]], cap: int
) -> None:
    tensors = [torch.zeros(n, dtype=dtype) for n, dtype in sizes]
    buckets = model_sync._buckets(tensors, cap)
    flat = [t for bucket in buckets for t in bucket]
    assert sorted(map(id, flat)) == sorted(map(id, tensors))
    for bucket in buckets:
        assert len({t.dtype for t in bucket}) == 1
        assert len(bucket) == 1 or sum(t.nbytes for t in bucket) <= cap
    for dtype in (torch.float32, torch.float64):
        in_buckets = [id(t) for t in flat if t.dtype == dtype]
        assert in_buckets == [id(t) for t in tensors if t.dtype == dtype]


def test_fallback_reduction_applies_each_op() -> None:
    parts = [torch.tensor([1, 6]), torch.tensor([4, 3]), torch.tensor([2, 5])]
    expected = {
        dist.ReduceOp.SUM: [7, 14],
        dist.ReduceOp.PRODUCT: [8, 90],
        dist.ReduceOp.MIN: [1, 3],
        dist.ReduceOp.MAX: [4, 6],
        dist.ReduceOp.BAND: [0, 0],
        dist.ReduceOp.BOR: [7, 7],
        dist.ReduceOp.BXOR: [7, 0],
    }
    for op, values in expected.items():
        assert torch_ops._reduce_local(parts, op, 3).tolist() == values
    assert torch_ops._reduce_local(
        [torch.tensor([1.0]), torch.tensor([2.0])], dist.ReduceOp.AVG, 2
    ).tolist() == [1.5]


def test_configure_all_to_all_validates_and_keeps_unset_fields() -> None:
    before = collectives.all_to_all_config()
    try:
        collectives.configure_all_to_all(small_message_bytes=1024)
        collectives.configure_all_to_all(check_sizes=True)
        assert collectives.all_to_all_config() == collectives.AllToAllConfig(1024, True)
        with pytest.raises(InvalidArgumentError, match=r"^small_message_bytes=-1 must be at least 0"):
            collectives.configure_all_to_all(small_message_bytes=-1)
    finally:
        collectives.configure_all_to_all(
            small_message_bytes=before.small_message_bytes, check_sizes=before.check_sizes
        )


def test_bucket_index_follows_the_le_rule() -> None:
    for i, bound in enumerate(metrics._BOUNDS_NS):
        assert metrics.bucket_index(bound - 1) == i
        assert metrics.bucket_index(bound) == i
        assert metrics.bucket_index(bound + 1) == i + 1
    assert metrics.bucket_index(-5) == 0


_DURATIONS = st.one_of(
    st.sampled_from(metrics._BOUNDS_NS),
    st.sampled_from([b + 1 for b in metrics._BOUNDS_NS]),
    st.integers(min_value=0, max_value=10**12),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(_DURATIONS, st.integers(min_value=0, max_value=1 << 40)), max_size=700))
def test_batched_fold_gives_the_totals_of_one_entry_at_a_time(calls: list[tuple[int, int]]) -> None:
    # The fold sorts each batch and bisects at the bounds; the reference is bucket_index per entry.
    # Up to 700 calls: batches folded at 256 pending and the rest at the snapshot.
    stats = metrics.CollectiveStats("test_op", "test_backend")
    for duration, nbytes in calls:
        stats.record(duration, nbytes)
    expected = [0] * (len(metrics._BOUNDS_NS) + 1)
    for duration, _ in calls:
        expected[metrics.bucket_index(duration)] += 1
    snap = stats.snapshot()
    assert snap.bucket_counts == tuple(expected)
    assert snap.count == len(calls)
    assert snap.sum_seconds == sum(d for d, _ in calls) / 1e9
    assert snap.bytes_sent == sum(n for _, n in calls)


def test_histogram_counts_a_duration_equal_to_a_bound_in_that_bucket() -> None:
    stats = metrics.CollectiveStats("test_op", "test_backend")
    stats.observe(time.perf_counter_ns() - 10**12, 5)  # 1000 s ago: +Inf
    snap = stats.snapshot()
    assert (snap.count, snap.bytes_sent, snap.bucket_counts[-1]) == (1, 5, 1)
    assert metrics._BOUNDS_NS[0] == 10_000
    assert metrics._LE_LABELS[:3] == ("1e-05", "2e-05", "5e-05")
    assert metrics._LE_LABELS[-2:] == (
        "60.0",
        "+Inf",
    )


def test_exposition_has_cumulative_buckets_and_one_worker_info_series() -> None:
    stats = metrics.collective_stats("unit_test_op", "gloo")
    stats.observe(time.perf_counter_ns(), 3)
    stats.error()
    metrics.set_worker_info(job="a", rank=1, world_size=2, backend="gloo", generation="1")
    metrics.set_worker_info(job="gnn", rank=3, world_size=8, backend="gloo", generation="2")
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'sar_collective_duration_seconds_bucket{backend="gloo",le="+Inf",op="unit_test_op"} 1.0' in text
    assert 'sar_collective_duration_seconds_count{backend="gloo",op="unit_test_op"} 1.0' in text
    assert 'sar_collective_bytes_total{backend="gloo",op="unit_test_op"} 3.0' in text
    assert 'sar_collective_errors_total{backend="gloo",op="unit_test_op"} 1.0' in text
    info = [line for line in text.splitlines() if line.startswith("sar_worker_info{")]
    assert info == ['sar_worker_info{backend="gloo",generation="2",job="gnn",rank="3",world_size="8"} 1.0']
    buckets = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sar_collective_duration_seconds_bucket") and 'op="unit_test_op"' in line
    ]
    assert buckets == sorted(buckets)
    assert len(buckets) == len(metrics.DURATION_BUCKETS_SECONDS) + 1
    last = metrics.last_collective()
    assert last is not None
    assert last.op == "unit_test_op"


def test_start_metrics_server_binds_a_free_port_and_refuses_a_second() -> None:
    host, port = metrics.start_metrics_server(0, host="127.0.0.1")
    try:
        assert host == "127.0.0.1"
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert b"sar_collective_duration_seconds" in response.read()
        with pytest.raises(
            InvalidArgumentError, match=rf"^a metrics server is already running on 127\.0\.0\.1:{port};"
        ):
            metrics.start_metrics_server(0, host="127.0.0.1")
    finally:
        metrics.stop_metrics_server()
    with pytest.raises(InvalidArgumentError, match=r"^port must be an integer in 0\.\.65535"):
        metrics.start_metrics_server(70000)
