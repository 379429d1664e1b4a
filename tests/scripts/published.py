"""Files a rank script writes for a test to read: whole, or not there at all.

A test polls for a rank's file (``rank0.pid``, ``rank0.json``) and reads it as soon as it exists;
``Path.write_text`` creates the file empty before it writes, so a reader can see ``''``. Every
rank script writes through :func:`publish`: the text goes to a hidden partial file beside the
target (no test's glob matches it) and is renamed over the target, which POSIX makes atomic.
"""

from __future__ import annotations

import os
from pathlib import Path


def publish(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the whole of it or no file."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, target)
