"""torchrun's rendezvous on sarcomm against torch's c10d (torchrun's default), side by side in one run.

Three parts (``--parts``, default all):

- ``formation``: N rendezvous handlers (N nodes) forming a world, at each of ``--sizes`` (default
  8, 64, 256, 1024). ``sarcomm``: the handler torchrun gets for ``--rdzv-backend=sarcomm`` (made
  through torch's registry, a real ``sar-coordinator`` on loopback), its connection made before the
  clock starts; each ``next_rendezvous()`` joins, and node rank 0 serves the generation's TCPStore
  that the others connect to. ``c10d``: torch's ``DynamicRendezvousHandler`` over
  ``C10dRendezvousBackend``, one store connection per node (what ``--rdzv-backend=c10d`` runs),
  under ``--c10d-deadline``; once a size misses it, larger sizes are skipped and reported "not
  within X s". The harness (client processes released at one instant, latencies from it) is
  ``rendezvous.py``'s.
- ``node-loss``: ``--nodes`` real torchrun nodes (``--nproc-per-node 2`` gloo workers each,
  ``tests/scripts/torchrun_train.py``, ``--nnodes 2:N``, ``--max-restarts 3``, everything else at
  torchrun's defaults) train; one node (not the one hosting c10d's store) is SIGKILLed (agent and
  workers) or SIGSTOPped (a hung host). Measured from the signal: every surviving node's workers
  of the old world gone ("stopped"), and every rank of the re-formed world having trained a step
  ("training"); each bounded by ``--loss-deadline`` and reported "not within X s" when it does not
  come.
- ``import``: what the ``torchrun.handlers`` entry point adds to ``import
  torch.distributed.elastic.rendezvous`` (torch loads it on every such import), in fresh processes.

Run (about 25 minutes on 2 cores)::

    python benchmarks/torchrun_rendezvous.py --markdown benchmarks/results/torchrun_rendezvous.md \\
        --json benchmarks/results/torchrun_rendezvous.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import rendezvous as rdv
from harness import CoordinatorProcess, free_port
from recording import write_results
from renderers import torchrun_rendezvous as torchrun_page
from renderers.torchrun_rendezvous import FormationRow, ImportCost, LossRound, LossRow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.torchrun_nodes import TRAIN, Node, records

PARTS = ("formation", "node-loss", "import")
# The key the formation's nodes count themselves in, on node rank 0's store.
_CONNECTED = "bench/connected"


# -- formation -------------------------------------------------------------------------------------


def _sarcomm_handler_client(
    link: rdv.Link, target: str, job: str, size: int, members: list[int], timeout: float
) -> list[tuple[int, float, int]]:
    """N torchrun nodes' sarcomm handlers, as torch's registry makes them, connected before the start."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    handlers = {}
    for i in members:
        params = RendezvousParameters("sarcomm", target, job, size, size, join_timeout=timeout)
        handlers[i] = get_rendezvous_handler(params)
        handlers[i].connect()  # type: ignore[attr-defined]  # the sarcomm handler's own method
    master: list[Any] = []

    def member(i: int) -> tuple[int, float, int]:
        info = handlers[i].next_rendezvous()
        done = time.monotonic()
        # After the clock: node rank 0's process serves the store the others connect to, so it
        # stays until every node has (a real agent stays for the whole job).
        info.store.add(_CONNECTED, 1)
        if info.rank == 0:
            master.append(info.store)
        return i, done, info.rank

    rows = rdv._run_threads(link, members, member, timeout)
    for store in master:
        deadline = time.monotonic() + timeout
        while store.add(_CONNECTED, 0) < size and time.monotonic() < deadline:
            time.sleep(0.05)
    return rows


def formation(args: argparse.Namespace, workdir: Path) -> list[FormationRow]:
    rows: list[FormationRow] = []
    c10d_missed: int | None = None
    rounds = 0
    with rdv.start_coordinator(workdir, "INFO") as coordinator:
        for warm_up, size in [(True, 8)] + [(False, s) for s in args.sizes]:
            # The first world of 8 warms the coordinator up, unreported.
            times, p50s, formed_at = [], [], []
            for _ in range(args.repeats):
                rounds += 1  # a job name per round: the handlers of a round never leave
                job = f"torchrun-{size}-{rounds}-{os.getpid()}"
                result, start_wall = rdv.run_round(
                    _sarcomm_handler_client, size, args.procs, (coordinator.target, job),
                    setup_timeout=args.setup_timeout, timeout=args.timeout,
                    server_cpu=coordinator.cpu_seconds,
                )  # fmt: skip
                times.append(result.formation_s)
                p50s.append(result.p50_s)
                _, formed = coordinator.job_times(job, start_wall)
                formed_at.append(formed)
            row: FormationRow = {
                "nodes": size,
                "sarcomm_p50_s": p50s,
                "coordinator_formed_s": formed_at,
                "sarcomm_s": statistics.median(times),
                "sarcomm_rounds_s": times,
            }
            if c10d_missed is not None and size > c10d_missed:
                row["c10d"] = f"not run (no world of {c10d_missed} within {args.c10d_deadline:g} s)"
            else:
                with rdv._master_store(args.c10d_deadline) as port:
                    try:
                        result, _ = rdv.run_round(
                            rdv._c10d_client, size, args.procs, (port, f"c10d-{size}-{os.getpid()}"),
                            setup_timeout=args.setup_timeout, timeout=args.c10d_deadline,
                            server_cpu=time.process_time,
                        )  # fmt: skip
                        row["c10d_s"] = result.formation_s
                    except rdv.RoundError as error:
                        c10d_missed = size
                        row["c10d"] = (
                            f"not within {args.c10d_deadline:g} s" if error.timed_out else str(error)[:200]
                        )
            if warm_up:
                continue
            rows.append(row)
            print(f"formation N={size}: {json.dumps(row)}", flush=True)
    return rows


# -- node loss -------------------------------------------------------------------------------------


def _node_args(backend: str, endpoint: str, job: str, out: Path, nodes: int) -> list[str]:
    return [
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job}",
        f"--nnodes=2:{nodes}",
        "--nproc-per-node=2",
        "--max-restarts=3",
        str(TRAIN),
        str(out),
    ]


def _first(predicate: Any, deadline: float, poll: float = 0.05) -> float | None:
    """The monotonic time ``predicate()`` first held, or None when ``deadline`` passed first."""
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(poll)
    return None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def node_loss_round(
    args: argparse.Namespace, backend: str, sig: signal.Signals, endpoint: str, workdir: Path, n: int
) -> LossRound:
    """One loss: ``args.nodes`` nodes train, one is signalled; the two times from the signal."""
    out = workdir / f"{backend}-{sig.name}-{n}"
    out.mkdir(parents=True)
    job = f"loss-{backend}-{sig.name}-{n}-{os.getpid()}"
    nodes = [
        Node(f"n{i}", _node_args(backend, endpoint, job, out, args.nodes), out / f"n{i}.log")
        for i in range(args.nodes)
    ]
    # The first node starts alone until its endpoint listens: with c10d it hosts the store, whose
    # loss ends every node (pytorch/pytorch#67742), so it is never the one lost.
    nodes[0].start()
    if (
        backend == "c10d"
        and _first(lambda: _listening(endpoint), time.monotonic() + args.setup_timeout) is None
    ):
        raise RuntimeError(f"c10d: the first node's store never listened on {endpoint}")
    for node in nodes[1:]:
        node.start()
    try:
        world: int = 2 * args.nodes
        trained = _first(
            lambda: len({r["rank"] for r in records(out) if "ok" in r and r["world"] == world}) == world,
            time.monotonic() + args.setup_timeout,
        )
        if trained is None:
            raise RuntimeError(f"{backend}: no world of {args.nodes} nodes trained; see {out}")
        victim = nodes[-1]
        lost_pids = {p.pid for p in victim.processes()}
        old = {r["pid"] for r in records(out) if r["world"] == world} - lost_pids
        signalled = victim.signal_all(sig)
        signalled_wall = time.time()
        deadline = signalled + args.loss_deadline
        stopped = _first(lambda: not any(_alive(pid) for pid in old), deadline)
        new_world: int = world - 2

        def reformed() -> bool:
            fresh = [
                r for r in records(out) if "ok" in r and r["time"] > signalled_wall and r["pid"] not in old
            ]
            ranks: set[int] = {r["rank"] for r in fresh if r["world"] == new_world}
            return len(ranks) == new_world

        training = _first(reformed, deadline)
        restarts = sorted({r["restart_count"] for r in records(out) if r["world"] == new_world})
        return {
            "stopped_s": None if stopped is None else stopped - signalled,
            "training_s": None if training is None else training - signalled,
            "torch_restarts": restarts,
        }
    finally:
        for node in nodes:
            node.stop()


def _listening(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    with socket.socket() as sock:
        return sock.connect_ex((host, int(port))) == 0


def _endpoint(backend: str, coordinator: str) -> str:
    """The coordinator's address, or for c10d a fresh port for the store its first node serves."""
    return coordinator if backend == "sarcomm" else f"127.0.0.1:{free_port()}"


def node_loss(args: argparse.Namespace, workdir: Path) -> list[LossRow]:
    rows: list[LossRow] = []
    # Not formation's coordinator, which judges silence slowly (--heartbeat-interval 600): one
    # with the default liveness settings, as a deployment runs.
    with _default_coordinator(workdir) as target:
        for sig in args.signals:
            for backend in ("sarcomm", "c10d"):
                if backend not in args.backends:
                    continue
                # c10d's endpoint is the store its first node serves: a fresh port each round.
                rounds = [
                    node_loss_round(args, backend, sig, _endpoint(backend, target), workdir, n)
                    for n in range(args.loss_repeats)
                ]
                row: LossRow = {
                    "signal": sig.name,
                    "backend": backend,
                    "rounds": rounds,
                    "stopped_s": _median_of_all([r["stopped_s"] for r in rounds]),
                    "training_s": _median_of_all([r["training_s"] for r in rounds]),
                }
                rows.append(row)
                print(f"node-loss: {json.dumps(row)}", flush=True)
    return rows


def _median_of_all(values: list[float | None]) -> float | None:
    """The median of ``values``, or None when any is missing (a round that missed its deadline)."""
    got = [v for v in values if v is not None]
    return statistics.median(got) if len(got) == len(values) else None


@contextlib.contextmanager
def _default_coordinator(workdir: Path) -> Iterator[str]:
    """A ``sar-coordinator`` with its default liveness settings (interval 1 s x 3 misses)."""
    with CoordinatorProcess(
        workdir / "coordinator-defaults.log", state=workdir / "defaults.sqlite", log_level="INFO"
    ) as coordinator:
        yield coordinator.target


# -- import ----------------------------------------------------------------------------------------

_IMPORT_PROBE = """
import importlib.metadata as md, time, torch, torch.distributed
eps = md.entry_points(group="torchrun.handlers")
t0 = time.perf_counter(); eps["sarcomm"].load()(); t1 = time.perf_counter()
import torch.distributed.elastic.rendezvous
t2 = time.perf_counter()
import sarcomm.worker.torchrun.handler
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2)
"""


def import_cost(args: argparse.Namespace) -> ImportCost:
    """Seconds the entry point adds, the rest of the rendezvous package's import, and what the
    handler module (loaded only for --rdzv-backend=sarcomm) would have cost at load."""
    samples = []
    for _ in range(args.import_repeats):
        out = subprocess.run(
            [sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, check=True
        )
        samples.append([float(x) for x in out.stdout.split()])
    entry, rest, handler = (statistics.median(column) for column in zip(*samples, strict=True))
    result: ImportCost = {
        "entry_point_ms": entry * 1e3,
        "rendezvous_import_rest_ms": rest * 1e3,
        "handler_module_ms": handler * 1e3,
    }
    print(f"import: {json.dumps(result)}", flush=True)
    return result


# -- report ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {','.join(PARTS)}")
    parser.add_argument("--sizes", type=lambda t: [int(x) for x in t.split(",")], default=[8, 64, 256, 1024])
    parser.add_argument("--procs", type=int, default=8, help="client processes the handlers are spread over")
    parser.add_argument("--repeats", type=int, default=3, help="sarcomm formation rounds per size (median)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a sarcomm formation may take")
    parser.add_argument("--c10d-deadline", type=float, default=60.0, help="seconds a c10d formation may take")
    parser.add_argument("--setup-timeout", type=float, default=240.0)
    parser.add_argument("--nodes", type=int, default=3, help="torchrun nodes of the node-loss part")
    parser.add_argument("--loss-repeats", type=int, default=2)
    parser.add_argument(
        "--signals",
        type=lambda t: [signal.Signals[f"SIG{x.strip().upper().removeprefix('SIG')}"] for x in t.split(",")],
        default=[signal.SIGKILL, signal.SIGSTOP],
        help="how the node is lost: KILL (agent and workers die), STOP (a hung host)",
    )
    parser.add_argument("--backends", default="sarcomm,c10d", help="node-loss backends, comma-separated")
    parser.add_argument("--loss-deadline", type=float, default=torchrun_page.LOSS_DEADLINE_S)
    parser.add_argument("--import-repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    command = shlex.join(
        ["python", "benchmarks/torchrun_rendezvous.py", *(sys.argv[1:] if argv is None else argv)]
    )
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    rdv.preload_torch()
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="sarcomm-trdzv-"))
        )
        workdir.mkdir(parents=True, exist_ok=True)
        if "import" in parts:
            results["import"] = import_cost(args)
        if "formation" in parts:
            results["formation"] = formation(args, workdir)
        if "node-loss" in parts:
            results["node-loss"] = node_loss(args, workdir)
    doc = {
        "benchmark": "torchrun_rendezvous",
        "title": torchrun_page.TITLE,
        "command": command,
        "settings": {"loss_deadline_s": args.loss_deadline},
        "machine": rdv.machine(),
        **results,
    }
    write_results(doc, torchrun_page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
