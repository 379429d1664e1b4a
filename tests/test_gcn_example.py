"""The GCN example, run as users run it: a real coordinator, two ``sar-worker`` agents with two
ranks each, gloo on loopback. Its per-epoch losses and final parameters must equal those of the
same model trained on the whole graph in one process (``--single``), to float64 rounding.

What makes them equal is the whole chain: the halo rows each rank fetches (``exchange_tensors``),
their gradients returned to the owners in the backward pass, the globally normalised loss and the
summed gradients (``gather_grads``). A row or a gradient lost or counted twice anywhere moves the
parameters by far more than the tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import CoordinatorProcess
from tests.helpers import SAR_WORKER

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gcn" / "train.py"
# Bounds each process's whole run: torch import, rendezvous, training, shutdown (about 10 s here).
DEADLINE_S = 90.0
WORLD_SIZE = 4
NODES = 1200
EPOCHS = 6
# float64: the two runs add the same terms in different orders (per partition and over ranks vs.
# one sparse product), which costs about 1e-16 relative per step; 1e-9 leaves room for that and
# none for a real difference.
RTOL, ATOL = 1e-9, 1e-12


def start(command: list[str]) -> subprocess.Popen[str]:
    # An outer sar-worker's or the developer's SAR_*/SARCOMM_* variables must not steer these.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(procs: dict[str, subprocess.Popen[str]], coord: CoordinatorProcess) -> dict[str, str]:
    """Each process's stdout once all exited 0; fails the test (killing the rest) otherwise."""
    outputs: dict[str, str] = {}
    try:
        for name, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running after {DEADLINE_S} s; coordinator:\n{coord.log()}")
            assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{stdout}\n{stderr}"
            outputs[name] = stdout
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    return outputs


@pytest.mark.parametrize(
    ("optimizer", "lr"),
    [
        # SGD moves each parameter by exactly lr x its gradient: any error in the summed gradient
        # shows, even a uniform scale that Adam's normalisation would hide.
        ("sgd", "0.5"),
        # Adam: the example's default.
        ("adam", "0.01"),
    ],
)
def test_distributed_gcn_training_equals_single_process_training(
    coordinator: CoordinatorProcess, tmp_path: Path, optimizer: str, lr: str
) -> None:
    train = ["--epochs", str(EPOCHS), "--nodes", str(NODES), "--dtype", "float64", "--optimizer", optimizer,
             "--lr", lr]  # fmt: skip
    agent = [
        *SAR_WORKER, "--coord", coordinator.grpc_target, "--job",
        f"gcn-{optimizer}", "--world-size", str(WORLD_SIZE), "--nproc-per-node", "2", "--backend", "gloo",
        "--socket-name", "lo", "--heartbeat-interval", "0.25", "--join-timeout", "60", "--",
        sys.executable, str(EXAMPLE), *train, "--out", str(tmp_path / "distributed.pt"),
    ]  # fmt: skip
    procs = {
        "agent a": start(agent),
        "agent b": start(agent),
        "single": start(
            [sys.executable, str(EXAMPLE), "--single", *train, "--out", str(tmp_path / "single.pt")]
        ),
    }
    outputs = finish(procs, coordinator)

    distributed = torch.load(tmp_path / "distributed.pt", weights_only=True)
    single = torch.load(tmp_path / "single.pt", weights_only=True)

    # The test means something only if every rank really depended on its peers.
    parts = distributed["parts"]
    assert distributed["world_size"] == WORLD_SIZE
    assert parts.shape == (WORLD_SIZE, 4)
    assert int(parts[:, 0].sum()) == NODES
    assert int(parts[:, 1].sum()) == int(single["parts"][0, 1]), "edges lost or duplicated by partitioning"
    assert (parts[:, 2] > 0).all(), f"a rank had no halo rows: {parts.tolist()}"
    assert int(parts[:, 2].sum()) == int(parts[:, 3].sum()), "rows received != rows sent"
    # Rank 0 prints the global loss per epoch through its agent.
    printed = "".join(outputs[name] for name in ("agent a", "agent b"))
    assert f"epoch {EPOCHS:3d}  loss {distributed['losses'][-1].item():.6f}" in printed, printed

    assert distributed["losses"].shape == (EPOCHS,)
    torch.testing.assert_close(distributed["losses"], single["losses"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(distributed["accuracy"], single["accuracy"], rtol=RTOL, atol=ATOL)
    assert all(value.dtype == torch.float64 for value in single["params"].values())
    # Mappings compare key by key; a failure names the parameter.
    torch.testing.assert_close(distributed["params"], single["params"], rtol=RTOL, atol=ATOL)
    assert distributed["losses"][-1] < distributed["losses"][0], "training did not lower the loss"
