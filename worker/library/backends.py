"""The decisions of communication start-up, as pure functions of their inputs: which backend,
which device, whether CPU tensors need a gloo side group, and the local rank when no launcher said.

Pure so that they are unit-tested without GPUs or a process group: what the process can use is
gathered once by :func:`probe_backends` and passed in as a :class:`BackendProbe`. What the
environment says (the timeouts, the master port, ``LOCAL_RANK``, the interface variables) is read
by :mod:`sarcomm.worker.launch_env` and passed in.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Final

import torch
import torch.distributed as dist

from sarcomm.common.constants import BACKENDS
from sarcomm.common.errors import InvalidArgumentError, shorten

__all__ = [
    "CCL_MODULE",
    "BackendProbe",
    "adopted_backend",
    "choose_backend",
    "choose_comm_device",
    "local_rank_from",
    "needs_cpu_side_group",
    "probe_backends",
    "uses_cpu_side_group",
]

#: The oneCCL bindings' module: importing it registers the "ccl" backend with torch.distributed.
CCL_MODULE: Final = "oneccl_bindings_for_pytorch"


@dataclass(frozen=True)
class BackendProbe:
    """What this process can use, gathered once by :func:`probe_backends` so that
    :func:`choose_backend` and :func:`choose_comm_device` stay pure (and testable with a fake)."""

    cuda_available: bool
    cuda_device_count: int
    gloo: bool
    nccl: bool
    mpi: bool
    ucc: bool
    ccl: bool

    def why_not(self, name: str) -> str | None:
        """Why backend ``name`` cannot be used here, or None when it can."""
        if name == "gloo":
            return None if self.gloo else "this torch build has no Gloo (dist.is_gloo_available() is False)"
        if name == "nccl":
            if not self.nccl:
                return "this torch build has no NCCL (dist.is_nccl_available() is False)"
            if not self.cuda_available:
                return "torch.cuda.is_available() is False"
            if self.cuda_device_count == 0:
                return "torch.cuda.device_count() is 0"
            return None
        if name == "mpi":
            return None if self.mpi else "dist.is_mpi_available() is False (torch was built without MPI)"
        if name == "ucc":
            return None if self.ucc else "dist.is_ucc_available() is False (torch was built without UCC)"
        if name == "ccl":
            return None if self.ccl else f"the {CCL_MODULE} package is not installed"
        return f"{name!r} is not a backend sarcomm knows"

    def available(self) -> list[str]:
        """Names of the usable backends, in :data:`BACKENDS` order."""
        return [name for name in BACKENDS[1:] if self.why_not(name) is None]


def probe_backends() -> BackendProbe:
    """Look at the torch build, the visible GPUs and the installed oneCCL bindings. Does not import
    the bindings (that registers a backend, with side effects); ``initialize_comms`` does, when
    ``ccl`` is chosen."""
    cuda = torch.cuda.is_available()
    return BackendProbe(
        cuda_available=cuda,
        cuda_device_count=torch.cuda.device_count() if cuda else 0,
        gloo=dist.is_gloo_available(),
        nccl=dist.is_nccl_available(),
        mpi=dist.is_mpi_available(),
        ucc=dist.is_ucc_available(),
        ccl=importlib.util.find_spec(CCL_MODULE) is not None,
    )


def choose_backend(requested: str, probe: BackendProbe) -> str:
    """The backend to initialise for ``requested`` (one of :data:`BACKENDS`).

    ``auto`` is ``nccl`` when CUDA is available with at least one device, else ``gloo``. Raises
    :class:`InvalidArgumentError` for an unknown name or an unavailable backend, naming why and
    which are available.
    """
    if requested not in BACKENDS:
        raise InvalidArgumentError(f"backend {shorten(requested)} is not one of {', '.join(BACKENDS)}.")
    name = requested
    if name == "auto":
        name = "nccl" if probe.why_not("nccl") is None else "gloo"
    why = probe.why_not(name)
    if why is not None:
        available = ", ".join(probe.available()) or "none"
        shown = f"'{requested}'" if requested == name else f"'{requested}' (resolved to '{name}')"
        raise InvalidArgumentError(f"backend {shown} is not available: {why}; available: {available}.")
    return name


def choose_comm_device(
    backend_name: str, requested: torch.device | str | None, local_rank: int, probe: BackendProbe
) -> torch.device:
    """The device tensors must be on to travel through ``backend_name``.

    ``requested`` wins when given. Otherwise ``cuda:<local_rank>`` for nccl (the device each local
    process owns) and ``cpu`` for every other backend. Raises :class:`InvalidArgumentError` when
    nccl's local rank has no device or ``requested`` is not a device.
    """
    if requested is not None:
        try:
            return torch.device(requested)
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgumentError(
                f"comm_device {shorten(requested)} is not a torch device (for example 'cpu' or 'cuda:0')."
            ) from exc
    if backend_name != "nccl":
        return torch.device("cpu")
    if not 0 <= local_rank < probe.cuda_device_count:
        raise InvalidArgumentError(
            f"LOCAL_RANK {local_rank} has no CUDA device: this host shows {probe.cuda_device_count}; "
            "the local rank must be below the device count for nccl (or pass comm_device)."
        )
    return torch.device("cuda", local_rank)


def needs_cpu_side_group(backend_name: str) -> bool:
    """Whether ``backend_name`` needs a gloo group beside it for CPU tensors (only nccl: it moves
    nothing but CUDA tensors; gloo, mpi, ucc and ccl handle CPU tensors themselves)."""
    return backend_name == "nccl"


def uses_cpu_side_group(tensor_is_cpu: bool, has_side_group: bool) -> bool:
    """Whether a collective on a tensor goes through the CPU side group rather than the default
    group: exactly when such a group exists (nccl jobs) and the tensor is in host memory."""
    return has_side_group and tensor_is_cpu


def local_rank_from(rank_: int, probe: BackendProbe, local_rank: int | None) -> int:
    """The local rank: ``local_rank`` (``LOCAL_RANK``) when a launcher said; without one, ranks are
    taken to fill each host's devices in order (``rank_`` modulo the device count)."""
    if local_rank is None:
        return rank_ % max(probe.cuda_device_count, 1)
    return local_rank


def adopted_backend(
    reported: str, requested_device: torch.device | None, probe: BackendProbe
) -> tuple[str, bool]:
    """The backend of a process group that already exists, from ``dist.get_backend()``, and whether
    that group also carries CPU tensors.

    torch reports a group created without a backend as e.g. ``cpu:gloo,cuda:nccl``: such a group
    routes by device itself, so it needs no CPU side group; the backend named is the one that
    serves ``requested_device`` (or CUDA when nccl is usable, else CPU).
    """
    if ":" not in reported:
        return reported, reported != "nccl"
    by_device = dict(part.split(":", 1) for part in reported.split(",") if ":" in part)
    if requested_device is not None and requested_device.type in by_device:
        key = requested_device.type
    elif "cuda" in by_device and probe.why_not("nccl") is None:
        key = "cuda"
    else:
        key = "cpu" if "cpu" in by_device else next(iter(by_device))
    return by_device[key], "cpu" in by_device
