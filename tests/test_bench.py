"""``sar-worker ... bench``: flag parsing, the arithmetic and the table, the checked cases in a real
gloo group, and one end-to-end run through a real coordinator and agent."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.agent import bench, cli
from sarcomm.worker.library import bench_rank
from tests.conftest import CoordinatorProcess
from tests.gloo_group import run_gloo
from tests.helpers import SAR_WORKER

# Bounds the end-to-end run: agent start, two ranks importing torch, a 42-row sweep, shutdown.
E2E_DEADLINE_S = 90.0
# Ranks of the in-process group: three, so that parts do not divide power-of-two sizes evenly.
WORLD = 3


def _settings(*argv: str) -> bench.BenchSettings:
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    return bench.BenchSettings.from_args(parser.parse_args(list(argv)))


# -- sizes, ops and flags ------------------------------------------------------------------------


def test_parse_size_reads_plain_bytes_and_1024_based_suffixes_in_any_case() -> None:
    assert bench.parse_size("512") == 512
    assert bench.parse_size("1K") == 1024
    assert bench.parse_size("64m") == 64 << 20
    assert bench.parse_size(" 2G ") == 2 << 30


@pytest.mark.parametrize("text", ["0", "-1", "1X", "", "K", "1.5K", "1KB"])
def test_parse_size_rejects_a_bad_size_naming_flag_value_and_rule(text: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        bench.parse_size(text, "--sizes")
    assert str(info.value) == (
        f"--sizes {text!r} must be a positive number of bytes with an optional K, M or G suffix "
        "(powers of 1024), e.g. 64K."
    )


def test_parse_sizes_expands_ranges_by_the_factor_and_merges_lists() -> None:
    assert bench.parse_sizes("1K:8K") == (1024, 2048, 4096, 8192)
    assert bench.parse_sizes("1K:64K", factor=4) == (1024, 4096, 16384, 65536)
    assert bench.parse_sizes("1K:5K") == (1024, 2048, 4096)  # MAX only when on the grid
    assert bench.parse_sizes("4K,1K,1K:2K") == (1024, 2048, 4096)
    assert bench.parse_sizes("3") == (3,)
    assert len(bench.parse_sizes("1K:64M")) == 17


def test_parse_sizes_rejects_bad_items_inverted_ranges_and_small_factors() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"^--sizes '1K:x' must be sizes or MIN:MAX ranges .*'1K:x' is not\.$"
    ):
        bench.parse_sizes("1K:x")
    with pytest.raises(InvalidArgumentError, match=r"^--sizes '1K,' must be .*'' is not\.$"):
        bench.parse_sizes("1K,")
    with pytest.raises(InvalidArgumentError, match=r"MIN <= MAX; '64K:1K' has MIN 65536 > MAX 1024\.$"):
        bench.parse_sizes("64K:1K")
    with pytest.raises(InvalidArgumentError, match=r"^--factor 1 must be an integer >= 2\.$"):
        bench.parse_sizes("1K:2K", factor=1)


def test_parse_ops_keeps_order_drops_repeats_and_expands_all() -> None:
    assert bench.parse_ops("all") == bench.OPS
    assert bench.parse_ops("broadcast, all_reduce,broadcast") == ("broadcast", "all_reduce")
    assert bench.parse_ops("all_to_all_unequal,all")[0] == "all_to_all_unequal"
    with pytest.raises(InvalidArgumentError, match=r"^--ops 'all_reduce,alltoall' must be .*'alltoall' is"):
        bench.parse_ops("all_reduce,alltoall")


def test_settings_default_to_the_whole_sweep() -> None:
    settings = _settings()
    assert settings.ops == bench.OPS
    assert settings.sizes[0] == 1024
    assert settings.sizes[-1] == 64 << 20
    assert (settings.iters, settings.warmup, settings.dtype, settings.json_path) == (20, 5, "float32", None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--iters", "0"], "--iters '0' must be an integer >= 1."),
        (["--iters", "x"], "--iters 'x' must be an integer >= 1."),
        (["--warmup", "-1"], "--warmup '-1' must be an integer >= 0."),
        (["--factor", "1"], "--factor '1' must be an integer >= 2."),
        (["--dtype", "float16"], "--dtype 'float16' must be one of float32, float64, int32, int64."),
        (["--json", ""], "--json '' must be the path of the file to write the results to."),
    ],
)
def test_settings_reject_bad_flags_naming_flag_value_and_rule(argv: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _settings(*argv)
    assert str(info.value) == message


def test_settings_argv_rebuilds_the_same_settings_for_the_ranks(tmp_path: Path) -> None:
    settings = _settings(
        "--ops", "broadcast,all_to_all_unequal", "--sizes", "1K:1M", "--factor", "4", "--iters", "7",
        "--warmup", "0", "--dtype", "int64", "--json", str(tmp_path / "out.json"),
    )  # fmt: skip
    assert _settings(*settings.argv()) == settings
    assert settings.json_path == tmp_path / "out.json"


def test_bad_bench_flag_fails_sar_worker_before_joining(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 9 (discard) has no coordinator: reaching it would be a different error, and slower.
    code = cli.main(
        ["--coord", "127.0.0.1:9", "--job", "j", "--world-size", "2", "bench", "--sizes", "1K:1Q"]
    )
    assert code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("sar-worker: error: bench: --sizes '1K:1Q' must be sizes or MIN:MAX ranges")


# -- arithmetic and output -------------------------------------------------------------------------


def test_bus_factors_are_nccl_tests() -> None:
    assert bench.bus_factor("all_reduce", 4) == 1.5
    for op in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_unequal"):
        assert bench.bus_factor(op, 4) == 0.75
    assert bench.bus_factor("broadcast", 4) == 1.0
    assert bench.bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(InvalidArgumentError, match=r"^op='gather' must be one of all_reduce, "):
        bench.bus_factor("gather", 4)


def test_element_count_rounds_split_ops_to_whole_parts_of_at_least_one_element() -> None:
    assert bench.element_count("all_reduce", 1000, 4, 3) == 250
    assert bench.element_count("all_gather", 1000, 4, 3) == 249
    assert bench.element_count("all_to_all", 4, 4, 4) == 4  # one element per rank at least
    assert bench.element_count("broadcast", 2, 8, 4) == 1


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_uneven_split_adds_up_differs_per_peer_and_is_the_same_everywhere(world: int) -> None:
    for total in (0, 1, 5, 1000, 4096):
        for src in range(world):
            parts = bench.uneven_split(total, src, world)
            assert sum(parts) == total
            assert min(parts) >= 0
            assert parts == bench.uneven_split(total, src, world)
    if world > 1:
        assert len(set(bench.uneven_split(4096, 0, world))) == world


def test_make_row_computes_algbw_and_busbw_in_gb_per_s() -> None:
    row = bench.make_row("all_reduce", 250_000, "float32", 0.001, 4, 0)
    assert (row.bytes, row.count, row.time_us) == (1_000_000, 250_000, 1000.0)
    assert row.algbw == pytest.approx(1.0)
    assert row.busbw == pytest.approx(1.5)


def test_format_table_has_nccl_tests_columns_rows_and_verdict() -> None:
    rows = [
        bench.make_row("all_reduce", 256, "float32", 50e-6, 2, 0),
        bench.make_row("broadcast", 256, "float32", 20e-6, 2, 3),
    ]
    text = bench.format_table(rows, ["title line"])
    lines = text.splitlines()
    assert lines[0] == "# title line"
    assert lines[2].split() == ["#", "op", "size", "count", "type", "time", "algbw", "busbw", "#wrong"]
    assert lines[3].split() == ["#", "(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)"]
    assert lines[4].split() == ["all_reduce", "1024", "256", "float32", "50.0", "0.020", "0.020", "0"]
    assert lines[5].split()[-1] == "3"
    assert "# Out of bounds values : 3 FAILED" in lines
    assert bench.format_table(rows[:1]).splitlines()[-2] == "# Out of bounds values : 0 OK"


def test_results_document_holds_the_rows_and_the_run() -> None:
    row = bench.make_row("all_gather", 512, "int32", 1e-4, 2, 0)
    document = bench.results_document([row], world_size=2, backend="gloo", host="h", date="d")
    assert json.loads(json.dumps(document)) == {
        "world_size": 2, "backend": "gloo", "host": "h", "date": "d",
        "rows": [{"op": "all_gather", "bytes": 2048, "count": 512, "dtype": "int32", "time_us": 100.0,
                  "algbw": row.algbw, "busbw": row.busbw, "wrong": 0}],
    }  # fmt: skip


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_one_line_per_row_in_a_file_and_one_rewritten_line_on_a_terminal() -> None:
    row = bench.make_row("all_reduce", 256, "float32", 50e-6, 2, 0)
    plain, tty = io.StringIO(), _Terminal()
    for stream in (plain, tty):
        progress = bench_rank._Progress(stream, 2)
        progress.row_done(row)
        progress.row_done(row)
        progress.close()
    lines = plain.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "bench: [1/2] all_reduce 1024 B: 50.0 us, busbw 0.020 GB/s, 0 wrong",
        "bench: [2/2] all_reduce 1024 B: 50.0 us, busbw 0.020 GB/s, 0 wrong",
    ]
    assert tty.getvalue().count("\n") == 1
    assert tty.getvalue().count("\r\x1b[K") == 2


# -- the checked cases in a real gloo group ----------------------------------------------------------


def _cases_and_rows(rank: int, world: int) -> dict[str, Any]:
    """Each op's case: wrong after a call (must be 0) and without one (must be caught); then
    measured rows through ``_measure``."""
    import torch

    env = bench_rank._Env(rank, world, torch.device("cpu"), torch.float32)
    checked: dict[str, tuple[int, int]] = {}
    for op in bench.OPS:
        case = bench_rank._build_case(op, env, bench.element_count(op, 4100, 4, world))
        case.reset()
        case.run()
        after_call = case.wrong()
        case.reset()  # outputs unwritten, in-place buffers still this rank's own input
        checked[op] = (after_call, case.wrong())
    settings = bench.BenchSettings(sizes=(1024, 4100), iters=2, warmup=1)
    rows = [bench_rank._measure(op, size, settings, env) for op in bench.OPS for size in settings.sizes]
    return {"checked": checked, "rows": rows}


@pytest.mark.integration  # a gloo group of processes
def test_cases_check_every_op_and_measure_the_same_rows_on_every_rank() -> None:
    results = run_gloo(WORLD, _cases_and_rows)
    for op in bench.OPS:
        assert all(results[r]["checked"][op][0] == 0 for r in range(WORLD)), op
        # A call that never happened is caught (somewhere: broadcast's root already has its data).
        assert sum(results[r]["checked"][op][1] for r in range(WORLD)) > 0, op
    rows = results[0]["rows"]
    assert [(row.op, row.bytes) for row in rows[:2]] == [("all_reduce", 1024), ("all_reduce", 4100)]
    assert [row.bytes for row in rows if row.op == "all_gather"] == [1020, 4092]  # whole parts of 3
    assert all(row.wrong == 0 and row.time_us > 0 for row in rows)
    # Times and wrong counts are reduced over the ranks: every rank has the same rows.
    assert all(results[r]["rows"] == rows for r in range(WORLD))


# -- end to end --------------------------------------------------------------------------------


def test_sar_worker_bench_runs_checks_and_reports_every_op(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    out = tmp_path / "results" / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    argv = [
        *SAR_WORKER, "--coord", coordinator.grpc_target, "--job", "bench",
        "--world-size", "2", "--nproc-per-node", "2", "--backend", "gloo", "--heartbeat-interval", "0.25",
        "--join-timeout", "60", "bench", "--sizes", "1K:64K", "--iters", "3", "--warmup", "1",
        "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=E2E_DEADLINE_S, check=False)
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert (document["world_size"], document["backend"], document["job"]) == (2, "gloo", "bench")
    assert document["host"]
    assert document["date"]
    sizes = [1024 << i for i in range(7)]
    assert [(row["op"], row["bytes"]) for row in document["rows"]] == [
        (op, s) for op in bench.OPS for s in sizes
    ]
    for row in document["rows"]:
        assert row["wrong"] == 0, row
        assert row["time_us"] > 0
        assert row["busbw"] == pytest.approx(row["algbw"] * bench.bus_factor(row["op"], 2))
    # Every measured call went through sarcomm's collectives, so its metrics recorded them.
    recorded = document["rank0_metrics"]
    calls_per_row = 1 + 3 + 1  # warm-up, timed, checked
    assert recorded["all_to_all/gloo"]["calls"] == 2 * 7 * calls_per_row
    assert recorded["all_gather/gloo"]["calls"] == 7 * calls_per_row
    # The table went to stdout, progress to stderr.
    table = done.stdout.splitlines()
    assert table[0].startswith("# sar-worker bench: job bench, generation 1, world size 2, backend gloo")
    assert table[-2] == "# Out of bounds values : 0 OK"
    assert sum(not line.startswith("#") for line in table) == 42
    assert "bench: [42/42] broadcast 65536 B:" in done.stderr
