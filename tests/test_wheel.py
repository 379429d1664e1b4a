"""The wheel a cluster installs: built by one command, installed into a fresh virtual environment,
and running a two-rank job from there (nothing of this checkout on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import CoordinatorProcess
from tests.helpers import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
JOB_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory, real_processes: None) -> Path:
    """A fresh venv with the wheel of this checkout installed; returns its bin folder."""
    directory = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-wheel.sh"), str(directory / "dist"), "--no-build-isolation"],
        capture_output=True, text=True, timeout=300, check=False,
        # The script builds with `python3`: this interpreter's, whether or not its venv is active.
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (directory / "dist").glob("sarcomm-*.whl")
    venv = directory / "venv"
    # Without its own pip or setuptools: this environment's pip installs into it (pip --python).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # torch and the other dependencies come from this environment (a .pth line adds its
    # site-packages), so the test does not download or unpack torch again; sarcomm itself comes
    # only from the wheel: the checkout's editable install is a finder hook that a .pth path line
    # does not load.
    site = Path(
        subprocess.check_output(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
         "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv / "bin"


def test_the_installed_package_comes_from_the_wheel_not_the_checkout(wheel_venv: Path) -> None:
    probe = "import sarcomm.common, sarcomm.worker; print(sarcomm.common.__file__)"
    where = subprocess.check_output([str(wheel_venv / "python"), "-c", probe], text=True, cwd="/")
    assert where.startswith(str(wheel_venv.parent)), where
    for command in ("sar-coordinator", "sar-worker"):
        shown = subprocess.run(
            [str(wheel_venv / command), "--help"], capture_output=True, text=True, timeout=60, check=False
        )
        assert shown.returncode == 0, shown.stderr
        assert "usage:" in shown.stdout


def test_a_two_rank_job_runs_from_the_wheel(wheel_venv: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    env["PATH"] = f"{wheel_venv}:{env.get('PATH', '')}"
    coord = CoordinatorProcess(
        grpc_port=free_port(), http_port=free_port(), state_path=tmp_path / "state.sqlite",
        args=[], log_path=tmp_path / "coordinator.log", env=env,
        command=[str(wheel_venv / "sar-coordinator")],
    )  # fmt: skip
    coord.start()
    try:
        job = subprocess.run(
            [
                str(wheel_venv / "sar-worker"), "--coord", coord.grpc_target, "--job", "wheel",
                "--world-size", "2", "--nproc-per-node", "2", "--backend", "gloo", "--socket-name", "lo",
                "--", str(wheel_venv / "python"), str(ROOT / "examples" / "collectives_check.py"),
            ],
            capture_output=True, text=True, timeout=JOB_DEADLINE_S, env=env, cwd=tmp_path, check=False,
        )  # fmt: skip
        assert job.returncode == 0, job.stdout + job.stderr
        for rank in (0, 1):
            assert f"rank {rank}/2 on " in job.stdout, job.stdout
        assert job.stdout.count("correct in 3 rounds") == 2, job.stdout
    finally:
        coord.stop()
