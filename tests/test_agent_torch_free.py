"""The ``sar-worker`` agent is torch-free: it starts in a fraction of a second and never pays for
``import torch`` (about 2 s of CPU a process, more on a busy host). Its ranks import torch; the agent
only launches and watches them. A fresh interpreter imports the agent's entry points and the
submodules they take from ``sarcomm.worker`` (whose names otherwise load the library, and torch).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

#: What a fresh interpreter imports, then prints whether torch came with it.
PROBE = """
import sys
import sarcomm.worker.agent.cli
import sarcomm.worker.agent.bench
from sarcomm.worker import bandwidth, launch_env
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.integration
def test_the_agents_entry_points_and_the_submodules_they_take_import_no_torch() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
