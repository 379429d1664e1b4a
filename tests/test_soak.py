"""A short soak (``benchmarks/soak.py --duration 36 --beats 2``): 1,000 simulated members join,
report twice and leave in waves for 36 s (about 11 waves of 3 s: 11,000 joins and leaves); the
coordinator's memory comes back to its baseline, and its file descriptors and threads do not grow.
``benchmarks/results/soak.md`` holds the five-minute run (124 waves, 4 reports a stream).

About 40 s; deselect with ``-m 'not soak'``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).parent.parent / "benchmarks" / "soak.py"


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_waves_of_1000_members_returns_the_coordinator_to_its_baseline_memory(
    tmp_path: Path,
) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SOAK), "--duration", "36", "--beats", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert out.exists(), done.stdout + done.stderr
    result = json.loads(out.read_text())
    waves = result["waves"]
    assert len(waves) >= 8, done.stdout
    assert all(w["joined"] == 1000 for w in waves)
    # 50 agent-style streams and 500 process streams, 2 reports each, every wave.
    assert all(w["reports"] == 1100 for w in waves)
    assert result["returned_to_baseline"], done.stdout
    measured = waves[2:]
    assert max(w["fds"] for w in measured) - min(w["fds"] for w in measured) <= 4, done.stdout
    assert max(w["threads"] for w in measured) - min(w["threads"] for w in measured) <= 2, done.stdout
    assert done.returncode == 0, done.stdout + done.stderr
