"""The checks of ``scripts/gpu-check.sh`` (run it, not this): a coordinator, then

1. one nccl rank under ``sar-worker`` (``scripts/gpu_check_rank.py``): out-of-place
   ``all_gather_into_tensor`` of 4 KiB to 1 GiB, the zero-code path's recorded duration against
   CUDA-event timings of the same calls (within 10% from 64 MiB, and far above the launch time),
   and what the library's wrapper records for its own calls;
2. a DDP script that never imports sarcomm (``tests/scripts/zerocode_ddp.py --backend nccl``)
   under ``torchrun --rdzv-backend=sarcomm``: every gradient all_reduce counted, its endpoint in
   the coordinator's ``/sd``.

Prints each figure and PASS/FAIL per check; exits 1 when any check failed. Every wait has a
deadline; every process it starts is stopped at the end.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DEADLINE_S = 120.0
STEPS = 20
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)
    if not ok:
        failures.append(what)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def wait(predicate: Any, what: str, timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def rank_check(coord: str, tmp: Path) -> None:
    print("== 1. one nccl rank: recorded duration against CUDA events (all_gather_into_tensor)", flush=True)
    run = subprocess.run(
        [PY, "-m", "sarcomm.worker.agent.cli", "--coord", coord, "--job", "gpu-rank", "--world-size", "1",
         "--backend", "nccl", "--join-timeout", "60", "--", PY, str(ROOT / "scripts" / "gpu_check_rank.py")],
        capture_output=True, text=True, timeout=DEADLINE_S * 2,
    )  # fmt: skip
    found = re.search(r"\{\"rows\".*\}", run.stdout)
    if run.returncode != 0 or found is None:
        check(
            False, f"the nccl rank ran (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        )
        return
    result = json.loads(found.group(0))
    check(bool(result["zerocode_on"]), "zero-code metrics on in the rank")
    heads = (
        ("bytes", 12),
        ("cuda events us", 15),
        ("zero-code us", 13),
        ("ratio", 7),
        ("launch us", 10),
        ("calls", 6),
    )
    print(" ".join(f"{name:>{width}}" for name, width in heads))
    for row in result["rows"]:
        ratio = row["zerocode_us"] / row["event_us"] if row["event_us"] else float("nan")
        print(
            f"{row['bytes']:>12} {row['event_us']:>15.1f} {row['zerocode_us']:>13.1f} {ratio:>7.3f} "
            f"{row['launch_us']:>10.1f} {row['zerocode_calls']:>6}"
        )
        check(row["zerocode_calls"] >= 20, f"{row['bytes']} B: every call recorded by the hook")
        if row["bytes"] >= 64 << 20:
            check(abs(ratio - 1) <= 0.10, f"{row['bytes']} B: zero-code within 10% of CUDA events")
            check(row["zerocode_us"] > 10 * row["launch_us"], f"{row['bytes']} B: far above the launch time")
    library = result["library_all_reduce_64MiB"]
    calls, recorded, event = library["calls"], library["recorded_us"], library["event_us"]
    print(
        f"library sar.all_reduce 64 MiB: {calls} calls, {recorded:.1f} us recorded each "
        f"(its CUDA events), {event:.1f} us by CUDA events around the calls"
    )
    check(library["calls"] == 20, "the library's calls counted once each")
    check(abs(recorded / event - 1) <= 0.10 if event else False, "library within 10% of CUDA events")


def ddp_check(coord: str, http: str, tmp: Path) -> None:
    print("== 2. DDP without sarcomm under torchrun --rdzv-backend=sarcomm (nccl)", flush=True)
    out = tmp / "ddp"
    out.mkdir()
    log = (tmp / "torchrun.log").open("wb")
    node = subprocess.Popen(
        [PY, "-m", "torch.distributed.run", "--rdzv-backend=sarcomm", f"--rdzv-endpoint={coord}",
         "--rdzv-id=gpu-ddp", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=0.1",
         str(ROOT / "tests" / "scripts" / "zerocode_ddp.py"), str(out), "--steps", str(STEPS),
         "--backend", "nccl"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        record = wait(
            lambda: [json.loads(p.read_text()) for p in out.glob("*.json")], "the DDP rank to train"
        )[0]
        check(bool(record["ok"]), "DDP's averaged gradients and the all_reduces are right")
        check(bool(record["instrumented"]), "the DDP rank is instrumented without importing sarcomm")
        groups = wait(
            lambda: [g for g in json.loads(get(f"{http}/sd")) if g["labels"].get("job") == "gpu-ddp"],
            "/sd to list the DDP rank",
        )
        check(len(groups) == 1, f"/sd lists the rank's endpoint: {groups}")
        target = groups[0]["targets"][0]

        def counted() -> float | None:
            text = get(f"http://{target}/metrics")
            line = re.search(
                r'sar_collective_duration_seconds_count\{backend="nccl",op="all_reduce"\} (\S+)', text
            )
            value = float(line.group(1)) if line else 0.0
            return value if value >= STEPS + 5 else None

        try:
            count = wait(counted, "the scrape to count every gradient all_reduce", timeout=30)
        except TimeoutError as exc:
            count = 0.0
            print(exc)
        check(count >= STEPS + 5, f"all_reduce count {count} >= {STEPS} DDP steps + 5 calls")
    finally:
        (out / "stop").touch()
        try:
            code = node.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            node.kill()
            code = -9
        check(code == 0, f"torchrun exited 0 (got {code}); log: {tmp / 'torchrun.log'}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="sarcomm-gpu-check-") as name:
        tmp = Path(name)
        grpc_port, http_port = free_port(), free_port()
        coord, http = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
        coordinator = subprocess.Popen(
            [PY, "-m", "sarcomm.coordinator.cli", "--listen", coord, "--http", f"127.0.0.1:{http_port}",
             "--state", str(tmp / "state.sqlite"), "--heartbeat-interval", "0.5"],
            stdout=(tmp / "coordinator.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait(lambda: get(f"{http}/healthz"), "the coordinator to serve /healthz", timeout=60)
            rank_check(coord, tmp)
            ddp_check(coord, http, tmp)
        except (TimeoutError, subprocess.TimeoutExpired) as exc:
            check(False, str(exc))
        finally:
            coordinator.terminate()
            try:
                coordinator.wait(10)
            except subprocess.TimeoutExpired:
                coordinator.kill()
    print(f"== {'ALL PASSED' if not failures else f'{len(failures)} FAILED'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
