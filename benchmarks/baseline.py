"""A module as it was at an earlier commit, loaded beside the current one, so that a benchmark
times the code before and after a change in one run (interleaved, on the same machine load).

``source_at(ref, path)`` reads the file from git; ``load(source, name)`` executes it as a module of
its own. The old module imports its neighbours from the current tree, so it runs as long as the
names it imports still exist: the all_to_all module of 3abd83d (``worker/alltoall.py`` there) imports
``sarcomm.worker.comm`` and four helpers of ``sarcomm.worker.timing``, names of the layout before
``worker/library/``, so a baseline from before the move needs a checkout of its own.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPOSITORY = Path(__file__).resolve().parent.parent


def source_at(ref: str, path: str) -> tuple[str, str]:
    """(full commit id, text of ``path``) at git revision ``ref`` of this repository."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"],
        cwd=REPOSITORY, capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    text = subprocess.run(
        ["git", "show", f"{commit}:{path}"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return commit, text


def load(source: str, name: str, origin: str) -> ModuleType:
    """Execute ``source`` as module ``name`` (registered in ``sys.modules``: dataclasses look their
    module up there); ``origin`` names it in tracebacks."""
    spec = importlib.util.spec_from_loader(name, loader=None, origin=origin)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(source, origin, "exec"), module.__dict__)
    return module
