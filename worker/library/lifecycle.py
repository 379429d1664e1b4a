"""Leaving a job on purpose: :func:`finalize`, the public counterpart of ``initialize_comms``.

A process that registered itself (``coord_ip_init`` or ``init(coord=...)``) reports ``Leave`` at
interpreter exit, and as a ``multiprocessing`` child when its target ends
(:mod:`sarcomm.worker.library.registration`); :func:`finalize` does the same at a moment the program
chooses (before a long post-processing step, or in a process that is not going to exit soon), and
ends the communication state so that nothing of the job outlives it.
"""

from __future__ import annotations

import logging

from sarcomm.worker.library import comm, registration
from sarcomm.worker.library.task_thread import comm_thread

__all__ = ["finalize"]

log = logging.getLogger(__name__)


def finalize() -> None:
    """End this rank's part in its job; idempotent (later calls do nothing).

    In order: the comm thread finishes the tasks already submitted and stops; the process groups
    :func:`~sarcomm.worker.library.comm.initialize_comms` created are destroyed (one it found already
    there is left to its owner; this is local, no collective); then a self-registered process
    reports ``Leave`` with exit code 0 to the coordinator and stops heartbeating (a job whose
    members have all left this way ends FINISHED). Under ``sar-worker`` there is nothing to
    report: the agent reports the rank's exit. Collectives called afterwards raise
    :class:`FailedPreconditionError`; ``initialize_comms`` may set up anew, but a process is one
    member, so it cannot register again.

    Blocks at most the comm thread's stop wait (5 s) plus the coordinator client's timeout. The
    ``Leave`` is reported even when destroying the groups raised; that error is raised afterwards.
    """
    comm_thread.stop()
    try:
        if comm.is_initialized():
            comm.destroy_comms()
    finally:
        if registration.leave(0, "finalize()"):
            log.info("left the job by finalize()")
