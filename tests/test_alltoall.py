"""all_to_all's equal-size path and its rounds (``max_collective_size``), in real gloo groups.

Each world size (2, 3, 4) runs one scenario in one group; every rank checks the values it
received and reports what went wrong, plus how many times each ``torch.distributed`` call ran (the
calls are counted by wrapping the real functions in the rank, not replaced), which tells the path
taken: the equal-size path is one ``ProcessGroup.alltoall`` (gloo's list all_to_all, called
directly), the hybrid path one ``all_to_all_single`` (and point-to-point messages), rounds one
``all_reduce`` and one exchange per round.

Two stand-ins, for what cannot run here: SAR itself (it needs DGL) is a module registered as
``sar.config`` with SAR's ``Config.max_collective_size`` attribute; a torch whose gloo lacks the
list all_to_all (before pytorch PR 165435) is a ``ProcessGroup.alltoall`` that raises that torch's
error.
"""

from __future__ import annotations

import collections
import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.library import collectives
from sarcomm.worker.library.collectives import alltoall
from tests.gloo_group import run_gloo

WORLD_SIZES = (2, 3, 4)
#: float32 elements per row in the mixed and rounds cases: one row is 1 KiB.
ROW = 256
#: The ``torch.distributed`` functions counted, and ``alltoall``: ``ProcessGroup.alltoall``.
COUNTED = ("alltoall", "all_to_all_single", "all_reduce", "isend")


class Counted:
    """Counts the calls of :data:`COUNTED`, passing them through."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._real = {name: getattr(dist, name) for name in COUNTED if name != "alltoall"}
        for name, real in self._real.items():
            setattr(dist, name, self._counting(name, real))
        self.real_alltoall = dist.ProcessGroup.alltoall
        self.counting_alltoall = self._counting("alltoall", self.real_alltoall)
        dist.ProcessGroup.alltoall = self.counting_alltoall  # type: ignore[method-assign]

    def _counting(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return real(*args, **kwargs)

        return counted

    def during(self, fn: Callable[[], Any]) -> dict[str, int]:
        before = collections.Counter(self.counts)
        fn()
        return {
            name: self.counts[name] - before[name] for name in COUNTED if self.counts[name] - before[name]
        }

    def restore(self) -> None:
        for name, real in self._real.items():
            setattr(dist, name, real)
        dist.ProcessGroup.alltoall = self.real_alltoall  # type: ignore[method-assign]


def block(src: int, dst: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What ``src`` sends ``dst``: distinct values per (src, dst, element)."""
    numel = 1
    for n in shape:
        numel *= n
    values = torch.arange(numel, dtype=torch.int64).reshape(shape) + 1000 * src + 100 * dst
    if dtype == torch.bool:
        return (values % 2).bool()
    if dtype.is_complex:
        return torch.complex(values.float(), -values.float()).to(dtype)
    return values.to(dtype)


# -- the scenario every rank runs (module level: pickled into the spawned processes) --------------


def _equal_cases(rank: int, world: int, calls: Counted) -> dict[str, Any]:
    """Equal sizes: values and the path, for dtypes, shapes, layouts and list kinds."""
    wrong: list[str] = []
    paths: dict[str, dict[str, int]] = {}

    def run(case: str, recv: list[torch.Tensor], send: list[torch.Tensor], **kwargs: Any) -> None:
        paths[case] = calls.during(lambda: collectives.all_to_all(recv, send, **kwargs))

    def expect(case: str, got: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        for src in range(world):
            if got[src].shape != shape or not torch.equal(got[src], block(src, rank, shape, dtype)):
                wrong.append(f"{case} from {src}")

    dtypes = (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.bool,
        torch.complex64,
    )
    for dtype in dtypes:
        for shape in ((5,), (3, 4), ()):
            case = f"{dtype}/{shape}"
            recv = [torch.zeros(shape, dtype=dtype) for _ in range(world)]
            run(case, recv, [block(rank, d, shape, dtype) for d in range(world)])
            expect(case, recv, shape, dtype)
    # Empty messages (zero rows) on every pair.
    empty = [torch.full((0, 3), -1.0) for _ in range(world)]
    run("empty", empty, [torch.zeros(0, 3) for _ in range(world)])
    wrong += [f"empty {i}" for i, t in enumerate(empty) if t.shape != (0, 3)]
    # Non-contiguous on both sides: every other column of wider tensors, the receive views filled in
    # place and the columns between them untouched.
    send_nc = [torch.cat([block(rank, d, (3, 4), torch.float32)] * 2, dim=1)[:, ::2] for d in range(world)]
    bases = [torch.full((3, 8), -7.0) for _ in range(world)]
    run("non-contiguous", [base[:, ::2] for base in bases], send_nc)
    for src, base in enumerate(bases):
        sent = torch.cat([block(src, rank, (3, 4), torch.float32)] * 2, dim=1)[:, ::2]
        if not torch.equal(base[:, ::2], sent) or not bool((base[:, 1::2] == -7.0).all()):
            wrong.append(f"non-contiguous from {src}")
    # The receive tensors are rows of one buffer: filled in place, nothing else written.
    buffer = torch.full((world + 1, 4), -3.0)
    run(
        "rows of a buffer",
        list(buffer[:world].unbind(0)),
        [block(rank, d, (4,), torch.float32) for d in range(world)],
    )
    expect("rows of a buffer", list(buffer[:world].unbind(0)), (4,), torch.float32)
    wrong += ["buffer's last row"] if not bool((buffer[world] == -3.0).all()) else []
    # The same list sent and received (SAR's callers do not, torch's all_to_all allows it).
    both = [block(rank, d, (2, 2), torch.float32) for d in range(world)]
    run("aliased", both, both)
    expect("aliased", both, (2, 2), torch.float32)
    # move_to_comm_device on a CPU job, and tuples (the general path: dist.all_to_all takes lists).
    recv = [torch.zeros(6) for _ in range(world)]
    run("moved", recv, [block(rank, d, (6,), torch.float32) for d in range(world)], move_to_comm_device=True)
    expect("moved", recv, (6,), torch.float32)
    recv_tuple = tuple(torch.zeros(6) for _ in range(world))
    paths["tuples"] = calls.during(
        lambda: collectives.all_to_all(
            recv_tuple, tuple(block(rank, d, (6,), torch.float32) for d in range(world))
        )
    )
    expect("tuples", list(recv_tuple), (6,), torch.float32)
    # Above 64 KiB a message, gloo's list all_to_all is slower than the packed exchange.
    big = alltoall.NATIVE_MAX_BYTES // 4 + 1
    recv = [torch.zeros(big) for _ in range(world)]
    run("above 64 KiB", recv, [block(rank, d, (big,), torch.float32) for d in range(world)])
    expect("above 64 KiB", recv, (big,), torch.float32)
    # At the threshold (packed everywhere, so the equal-size path) and one byte above (point to point).
    default = collectives.all_to_all_config().small_message_bytes
    for case, small in (("at threshold", 4 * 64), ("above threshold", 4 * 64 - 1)):
        collectives.configure_all_to_all(small_message_bytes=small)
        try:
            recv = [torch.zeros(64) for _ in range(world)]
            run(case, recv, [block(rank, d, (64,), torch.float32) for d in range(world)])
            expect(case, recv, (64,), torch.float32)
        finally:
            collectives.configure_all_to_all(small_message_bytes=default)
    return {"wrong": wrong, "paths": paths}


def mixed_rows(src: int, dst: int, equal_rows: int) -> int:
    """Rows ``src`` sends ``dst``: ``equal_rows`` to and from rank 0 (whose sizes are all equal),
    3, 5, 8 or 1 between the other ranks (unequal on each of them: packed or point to point at
    4 KiB)."""
    if src == 0 or dst == 0:
        return equal_rows
    return (3, 5, 8, 1)[(src + 2 * dst) % 4]


def mixed_dtype(src: int, dst: int, others: torch.dtype) -> torch.dtype:
    """float32 to and from rank 0; ``others`` between the other ranks."""
    return torch.float32 if src == 0 or dst == 0 else others


def _mixed_cases(rank: int, world: int, calls: Counted) -> dict[str, Any]:
    """Rank 0's sizes are equal, the others' are not: rank 0 takes the equal-size path, the others
    the hybrid one, in the same call; then an all_reduce checks that the ranks are still in step.
    With int64 between the other ranks, their hybrid path packs bytes (element size 1) where rank 0
    sends float32 (element size 4)."""
    wrong: list[str] = []
    paths: dict[str, dict[str, int]] = {}
    default = collectives.all_to_all_config().small_message_bytes
    collectives.configure_all_to_all(small_message_bytes=4 * 1024)
    try:
        for equal_rows, others in (
            (2, torch.float32),
            (0, torch.float32),
            (4, torch.float32),
            (2, torch.int64),
        ):
            case = f"rank 0 equal at {equal_rows} rows, {others} between the others"

            def message(src: int, dst: int) -> torch.Tensor:
                shape = (mixed_rows(src, dst, equal_rows), ROW)  # noqa: B023
                return block(src, dst, shape, mixed_dtype(src, dst, others))  # noqa: B023

            send = [message(rank, d) for d in range(world)]
            recv = [torch.zeros_like(message(s, rank)) for s in range(world)]
            paths[case] = calls.during(functools.partial(collectives.all_to_all, recv, send))
            wrong += [
                f"{case} from {src}" for src in range(world) if not torch.equal(recv[src], message(src, rank))
            ]
            total = torch.tensor([float(rank + 1)])
            dist.all_reduce(total)
            if float(total) != world * (world + 1) / 2:
                wrong.append(f"{case}: all_reduce after it gave {float(total)}")
    finally:
        collectives.configure_all_to_all(small_message_bytes=default)
    return {"wrong": wrong, "paths": paths}


def rounds_rows(src: int, dst: int) -> int:
    """Rows ``src`` sends ``dst`` in the rounds cases: 0 to 9, unequal."""
    return (3 * src + 5 * dst + 1) % 10


def sar_rounds(world: int, limit: int, row: int) -> int:
    """SAR's count of rounds for the rounds cases, computed here from every rank's sizes."""
    per_rank = [
        sum(rounds_rows(me, d) * row for d in range(world))
        + sum(rounds_rows(s, me) * row for s in range(world))
        for me in range(world)
    ]
    return max(max(1, elements // limit) for elements in per_rank)


def _rounds_cases(rank: int, world: int, calls: Counted) -> dict[str, Any]:
    """max_collective_size: the same values as without it, above and below the limit, through
    sarcomm's setting and SAR's Config; the number of rounds is SAR's."""
    wrong: list[str] = []
    paths: dict[str, dict[str, int]] = {}
    expected_rounds: dict[str, int] = {}

    def unequal(case: str, row: int = 3, non_contiguous: bool = False) -> None:
        send = [block(rank, d, (rounds_rows(rank, d), row), torch.int64) for d in range(world)]
        if non_contiguous:
            send = [t.t().contiguous().t() for t in send]
        recv = [torch.full((rounds_rows(s, rank), row), -1, dtype=torch.int64) for s in range(world)]
        paths[case] = calls.during(lambda: collectives.all_to_all(recv, send))
        for src in range(world):
            if not torch.equal(recv[src], block(src, rank, (rounds_rows(src, rank), row), torch.int64)):
                wrong.append(f"{case} from {src}")

    try:
        for limit in (1, 7, 40, 10**9):  # many rounds (more rounds than rows), some, one
            collectives.configure_all_to_all(max_collective_size=limit)
            unequal(f"limit {limit}")
            expected_rounds[f"limit {limit}"] = sar_rounds(world, limit, 3)
        collectives.configure_all_to_all(max_collective_size=20)
        unequal("non-contiguous", non_contiguous=True)
        expected_rounds["non-contiguous"] = sar_rounds(world, 20, 3)
        # Equal sizes with a limit: rounds too (the equal-size path does not apply), 0-d and empty.
        for case, shape in (("equal", (6, 2)), ("scalars", ()), ("empty", (0, 2))):
            recv = [torch.full(shape, -1.0) for _ in range(world)]
            send = [block(rank, d, shape, torch.float32) for d in range(world)]
            paths[f"equal sizes, {case}"] = calls.during(
                functools.partial(collectives.all_to_all, recv, send)
            )
            if any(not torch.equal(recv[s], block(s, rank, shape, torch.float32)) for s in range(world)):
                wrong.append(f"equal sizes, {case}")
        # With check_sizes as well: sizes compared once, then the rounds.
        collectives.configure_all_to_all(check_sizes=True)
        unequal("check_sizes")
        expected_rounds["check_sizes"] = sar_rounds(world, 20, 3)
        collectives.configure_all_to_all(check_sizes=False, max_collective_size=5)
        got = collectives.exchange_tensors(
            [block(rank, d, (rounds_rows(rank, d), 2), torch.int64) for d in range(world)]
        )
        if any(
            not torch.equal(got[s], block(s, rank, (rounds_rows(s, rank), 2), torch.int64))
            for s in range(world)
        ):
            wrong.append("exchange_tensors")
        collectives.configure_all_to_all(max_collective_size=0)
        # SAR's Config (a stand-in module: SAR needs DGL), read at each call while sarcomm's is 0.
        sar_config = types.ModuleType("sar.config")
        config_class = type("Config", (), {"max_collective_size": 0})
        sar_config.Config = config_class  # type: ignore[attr-defined]
        sys.modules["sar.config"] = sar_config
        try:
            unequal("SAR's Config at 0")
            config_class.max_collective_size = 7  # type: ignore[attr-defined]
            unequal("SAR's Config at 7")
            expected_rounds["SAR's Config at 7"] = sar_rounds(world, 7, 3)
            collectives.configure_all_to_all(max_collective_size=40)
            unequal("sarcomm's 40 over SAR's 7")
            expected_rounds["sarcomm's 40 over SAR's 7"] = sar_rounds(world, 40, 3)
            collectives.configure_all_to_all(max_collective_size=0)
            config_class.max_collective_size = -1  # type: ignore[attr-defined]
            try:
                collectives.all_to_all([torch.zeros(1)] * world, [torch.zeros(1)] * world)
            except InvalidArgumentError as exc:
                paths["bad SAR value"] = {"error": 1}
                wrong += (
                    [] if str(exc).startswith("sar.Config.max_collective_size=-1 must be") else [str(exc)]
                )
        finally:
            del sys.modules["sar.config"]
    finally:
        collectives.configure_all_to_all(max_collective_size=0, check_sizes=False)
    return {"wrong": wrong, "paths": paths, "expected_rounds": expected_rounds}


def _old_torch_cases(rank: int, world: int, calls: Counted) -> dict[str, Any]:
    """A torch whose gloo lacks the list all_to_all, on rank 0 only and then on every rank: the
    first equal-size call falls back to the hybrid path with the right values, and so do later ones."""
    wrong: list[str] = []
    paths: dict[str, dict[str, int]] = {}

    def refuse(*args: Any, **kwargs: Any) -> None:
        calls.counts["refused"] += 1
        raise RuntimeError("Backend gloo does not support alltoall")

    for case, old in (("rank 0 old", rank == 0), ("every rank old", True), ("again", True)):
        dist.ProcessGroup.alltoall = refuse if old else calls.counting_alltoall  # type: ignore[assignment,method-assign]
        try:
            recv = [torch.zeros(3) for _ in range(world)]
            send = [block(rank, d, (3,), torch.float32) for d in range(world)]
            paths[case] = calls.during(functools.partial(collectives.all_to_all, recv, send))
            paths[case]["refused"] = calls.counts["refused"]
            if any(not torch.equal(recv[s], block(s, rank, (3,), torch.float32)) for s in range(world)):
                wrong.append(case)
        finally:
            dist.ProcessGroup.alltoall = calls.counting_alltoall  # type: ignore[method-assign]
        if case == "rank 0 old":
            alltoall._gloo_lists = True  # rank 0 learnt; start the next case afresh
    alltoall._gloo_lists = True  # this torch has it (the scenario runs these cases only then)
    return {"wrong": wrong, "paths": paths}


def _probe(rank: int, world: int, calls: Counted) -> dict[str, Any]:
    """One equal-size call: its values, its path, and whether this torch's gloo has the list
    all_to_all (an older one refuses it and the call falls back; later calls skip the attempt)."""
    recv = [torch.zeros(2) for _ in range(world)]
    send = [block(rank, d, (2,), torch.float32) for d in range(world)]
    path = calls.during(functools.partial(collectives.all_to_all, recv, send))
    right = all(torch.equal(recv[s], block(s, rank, (2,), torch.float32)) for s in range(world))
    return {"right": right, "path": path, "gloo lists": alltoall._gloo_lists}


def _scenario(rank: int, world: int) -> dict[str, Any]:
    calls = Counted()
    try:
        probe = _probe(rank, world, calls)
        return {
            "probe": probe,
            "equal": _equal_cases(rank, world, calls),
            "mixed": _mixed_cases(rank, world, calls),
            "rounds": _rounds_cases(rank, world, calls),
            "old torch": _old_torch_cases(rank, world, calls) if probe["gloo lists"] else None,
        }
    finally:
        calls.restore()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest, real_processes: None) -> tuple[int, dict[int, dict[str, Any]]]:
    size = int(request.param)
    return size, run_gloo(size, _scenario, deadline_s=150.0)


# -- the tests -----------------------------------------------------------------------------------

HYBRID = {"all_to_all_single": 1}


def equal_path(results: dict[int, dict[str, Any]]) -> dict[str, int]:
    """What an equal-size call runs on this torch: gloo's list all_to_all where it has one (torch
    2.13 here), else the hybrid path (torch 2.2: the first call tried and fell back, see the probe)."""
    return {"alltoall": 1} if results[0]["probe"]["gloo lists"] else HYBRID


def test_the_first_equal_size_call_delivers_and_finds_out_whether_gloo_has_list_all_to_all(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world
    has_lists = results[0]["probe"]["gloo lists"]
    for rank, r in results.items():
        assert r["probe"]["right"], f"rank {rank}"
        assert r["probe"]["gloo lists"] == has_lists
        assert r["probe"]["path"] == (
            {"alltoall": 1} if has_lists else {"alltoall": 1, "all_to_all_single": 1}
        )


def test_equal_sizes_take_gloos_all_to_all_and_fill_the_receive_tensors_in_place(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world
    native = equal_path(results)
    for rank, r in results.items():
        equal = r["equal"]
        assert equal["wrong"] == [], f"rank {rank}"
        for case, path in equal["paths"].items():
            if case == "tuples" or "complex" in case or case == "above 64 KiB":
                assert path == HYBRID, case
            elif case == "above threshold":
                assert path["all_to_all_single"] == 1, case
                assert path["isend"] >= 1, case
                assert "alltoall" not in path, case
            else:
                assert path == native, case


def test_ranks_on_different_paths_exchange_correctly_and_stay_in_step(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    size, results = world
    native = equal_path(results)
    for rank, r in results.items():
        mixed = r["mixed"]
        assert mixed["wrong"] == [], f"rank {rank}"
        for case, path in mixed["paths"].items():
            if rank == 0:
                assert path == native, case
            else:
                assert path.get("all_to_all_single") == 1, (rank, case)
                assert "alltoall" not in path, (rank, case)
    # Point-to-point messages ran beside rank 0's equal-size call (5 and 8 rows are above 4 KiB).
    assert size == 2 or any(
        r["mixed"]["paths"]["rank 0 equal at 2 rows, torch.float32 between the others"].get("isend")
        for r in results.values()
    )


def test_max_collective_size_runs_sars_number_of_rounds_with_the_same_values(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world
    for rank, r in results.items():
        rounds = r["rounds"]
        assert rounds["wrong"] == [], f"rank {rank}"
        paths = rounds["paths"]
        for case, expected in rounds["expected_rounds"].items():
            # One all_reduce agrees on the count, then one packed exchange per round.
            # (check_sizes adds an all_to_all_single and an all_reduce of its own.)
            extra = 1 if case == "check_sizes" else 0
            assert paths[case]["all_reduce"] == 1 + extra, case
            assert paths[case]["all_to_all_single"] == expected + extra, case
        assert rounds["expected_rounds"]["limit 1"] > max(
            rounds_rows(s, d) for s in range(4) for d in range(4)
        )
        assert rounds["expected_rounds"]["limit 1000000000"] == 1
        for case in ("equal sizes, equal", "equal sizes, scalars", "equal sizes, empty"):
            assert paths[case]["all_reduce"] == 1, case
            assert "alltoall" not in paths[case], case
        assert paths["SAR's Config at 0"] == HYBRID
        assert paths["bad SAR value"] == {"error": 1}


def test_a_torch_without_gloos_list_all_to_all_falls_back_on_the_first_call(
    world: tuple[int, dict[int, dict[str, Any]]],
) -> None:
    _, results = world
    if not results[0]["probe"]["gloo lists"]:
        pytest.skip("this torch's gloo has no list all_to_all: the probe saw the fallback for real")
    for rank, r in results.items():
        old = r["old torch"]
        assert old["wrong"] == [], f"rank {rank}"
        paths = old["paths"]
        if rank == 0:
            assert paths["rank 0 old"] == {"all_to_all_single": 1, "refused": 1}
        else:
            assert paths["rank 0 old"] == {"alltoall": 1, "refused": 0}
        # The first refusal is remembered: "again" is not tried natively.
        assert paths["every rank old"]["all_to_all_single"] == 1
        assert paths["again"]["refused"] == paths["every rank old"]["refused"]


# -- single process ------------------------------------------------------------------------------


def test_configure_max_collective_size_validates_and_keeps_the_other_fields() -> None:
    before = collectives.all_to_all_config()
    try:
        collectives.configure_all_to_all(max_collective_size=1000)
        assert collectives.all_to_all_config() == collectives.AllToAllConfig(
            before.small_message_bytes, before.check_sizes, 1000
        )
        for bad, message in (
            (-1, r"^max_collective_size=-1 must be at least 0 \(number of elements; 0 = no limit\)\.$"),
            ("10", r"^max_collective_size='10' must be an integer number of elements\.$"),
            (True, r"^max_collective_size=True must be an integer number of elements\.$"),
        ):
            with pytest.raises(InvalidArgumentError, match=message):
                collectives.configure_all_to_all(max_collective_size=bad)  # type: ignore[arg-type]
        assert collectives.all_to_all_config().max_collective_size == 1000
    finally:
        collectives.configure_all_to_all(max_collective_size=before.max_collective_size)


def test_the_limit_in_force_is_sarcomms_then_sars_then_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert alltoall.max_collective_size() == 0
    sar_config = types.ModuleType("sar.config")
    sar_config.Config = type("Config", (), {"max_collective_size": 300})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sar.config", sar_config)
    assert alltoall.max_collective_size() == 300
    try:
        collectives.configure_all_to_all(max_collective_size=50)
        assert alltoall.max_collective_size() == 50
    finally:
        collectives.configure_all_to_all(max_collective_size=0)
    sar_config.Config.max_collective_size = 2.5
    with pytest.raises(
        InvalidArgumentError, match=r"^sar\.Config\.max_collective_size=2\.5 must be an integer"
    ):
        alltoall.max_collective_size()


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 17])
@pytest.mark.parametrize("rounds", [1, 2, 3, 7, 20])
def test_round_slices_cover_every_row_once_in_order(rows: int, rounds: int) -> None:
    t = torch.arange(rows)
    parts = [alltoall._round_slice(t, r, rounds) for r in range(rounds)]
    assert torch.equal(torch.cat(parts), t)
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
