"""SAR's keyword names for the arguments sarcomm names differently.

SAR's ``sar.comm`` spells some parameters its own way (``initialize_comms(_rank, _world_size, ...,
_comm_device=...)``, ``all_to_all(recv_tensors, send_tensors)``, ``all_reduce(red_tensor, op)``);
code that passes them by keyword must keep working when sarcomm is swapped in, and sarcomm's own
names must keep working too. Each such function takes both spellings, SAR's as keyword-only
parameters defaulting to None, and resolves them here:

- one spelling given: its value;
- both given: ``TypeError`` naming both (as Python does for an argument given twice);
- neither given for a required argument: ``TypeError`` naming both (as Python does for a missing
  one).

Also the list of SAR's ``sar.comm`` names that live outside :mod:`sarcomm.worker.library.comm`. Pure, no
torch: the start-up code and the collectives both use it.
"""

from __future__ import annotations

from typing import Final, TypeVar

__all__ = ["SAR_COMM_NAMES_ELSEWHERE", "one_of", "required"]

#: SAR's ``sar.comm`` names that sarcomm defines outside :mod:`sarcomm.worker.library.comm`; that module
#: resolves them too, because SAR's code reaches them as ``sar.comm.all_reduce(...)``.
SAR_COMM_NAMES_ELSEWHERE: Final = frozenset(
    {"all_to_all", "all_reduce", "exchange_tensors", "exchange_single_tensor", "sync_params", "gather_grads",
     "CommThread", "comm_thread", "nfs_ip_init"}
)  # fmt: skip

_T = TypeVar("_T")


def one_of(func: str, name: str, value: _T | None, sar_name: str, sar_value: _T | None) -> _T | None:
    """The argument given as ``name`` or as SAR's ``sar_name`` (None when neither was).

    Raises ``TypeError`` naming both when both were given.
    """
    if sar_value is None:
        return value
    if value is not None:
        raise TypeError(
            f"{func}() got both {name!r} and {sar_name!r}, SAR's name for the same argument: pass one "
            "of them."
        )
    return sar_value


def required(func: str, name: str, value: _T | None, sar_name: str, sar_value: _T | None) -> _T:
    """:func:`one_of` for an argument that must be given; ``TypeError`` naming both when neither was."""
    chosen = one_of(func, name, value, sar_name, sar_value)
    if chosen is None:
        raise TypeError(f"{func}() missing required argument {name!r} (SAR's name: {sar_name!r}).")
    return chosen
