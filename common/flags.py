"""Flags and their environment variables: one mechanism for ``sar-coordinator`` and ``sar-worker``.

Each program declares its flags once, as :class:`Option` rows: the flag, how its text converts
(a function that raises ``ValueError`` for a value its rule forbids), the rule in words, the help,
the default. :func:`add_options` puts them on an ``argparse`` parser as plain strings, and
:func:`resolve_all` gives each its value, in this order: the flag on the command line, then its
variable (``SARCOMM_<FLAG>``, and any ``also_env``), then what the caller's ``fallback`` says
(e.g. Slurm's variables, read only when asked), then the default. Every bad value, from a flag or
from a variable, is the same one line: ``--flag VALUE must be RULE.`` or ``SARCOMM_FLAG=VALUE must
be RULE.`` (an :class:`~sarcomm.common.errors.InvalidArgumentError`; the programs print it and exit
2). The help text of every option ends ``(env VARIABLE; default VALUE)``, which ``docs/flags.md``
is generated from (``scripts/gen_flags.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sarcomm.common import durations
from sarcomm.common.errors import InvalidArgumentError, shorten

__all__ = [
    "ENV_PREFIX",
    "NONNEGATIVE_SECONDS_RULE",
    "SECONDS_RULE",
    "Fallback",
    "Option",
    "add_options",
    "env_name",
    "integer",
    "nonempty",
    "nonnegative_seconds",
    "resolve",
    "resolve_all",
    "seconds",
    "switch",
]

#: Every flag ``--some-flag`` also reads ``SARCOMM_SOME_FLAG``.
ENV_PREFIX = "SARCOMM_"

#: dest -> a function giving (source, text) for an option no flag or variable sets.
Fallback = Mapping[str, Callable[[], tuple[str, str]]]


def env_name(flag: str) -> str:
    """The variable of ``flag``: ``--heartbeat-interval`` -> ``SARCOMM_HEARTBEAT_INTERVAL``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class Option:
    """One flag: ``convert`` turns its text into the value (``ValueError``/``TypeError`` for a
    value against ``rule``; an :class:`InvalidArgumentError` for one that names the part at fault);
    ``rule`` completes "must be ..."; ``default`` is the value when nothing sets it (converted
    already); ``shown_default`` is what ``--help`` names when that is not ``default`` itself."""

    flag: str
    convert: Callable[[str], Any]
    rule: str
    help: str
    default: Any = None
    metavar: str | None = None
    required: bool = False
    also_env: tuple[str, ...] = ()
    dest_name: str | None = None
    shown_default: str | None = None
    #: A switch takes no value on the command line (``--json``); its variable is a boolean word.
    is_switch: bool = False
    #: The text of a flag given without a value (``--watch`` alone); None: a value is required.
    const: str | None = None

    @property
    def dest(self) -> str:
        return self.dest_name or self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return env_name(self.flag)


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Add ``options`` to ``parser``, each as a plain string (converted by :func:`resolve`)."""
    for option in options:
        more = f" or {', '.join(option.also_env)}" if option.also_env else ""
        shown = option.shown_default if option.shown_default is not None else option.default
        default = "" if shown in (None, "") or option.is_switch else f"; default {shown}"
        help_text = f"{option.help} (env {option.env}{more}{default})"
        if option.is_switch:
            parser.add_argument(
                option.flag, dest=option.dest, action="store_const", const="1", help=help_text
            )
        elif option.const is not None:
            parser.add_argument(
                option.flag, dest=option.dest, metavar=option.metavar, nargs="?", const=option.const,
                help=help_text,
            )  # fmt: skip
        else:
            parser.add_argument(option.flag, dest=option.dest, metavar=option.metavar, help=help_text)


def resolve(
    option: Option, given: str | None, env: Mapping[str, str], fallback: Fallback | None = None
) -> Any:
    """``option``'s value: ``given`` (the flag's text), else its variables, else ``fallback``'s
    word for its dest (called only then: a variable a flag replaces is never read), else the
    default; converted and checked.

    Raises:
        InvalidArgumentError: a required option nothing sets, or a value against the rule (the
            message names the flag or variable, the value and the rule).
    """
    if given is not None:
        source, text = option.flag, given
    else:
        found = next((v for v in (option.env, *option.also_env) if v in env), None)
        if found is not None:
            source, text = found, env[found]
        elif fallback is not None and option.dest in fallback:
            source, text = fallback[option.dest]()
        elif option.required:
            raise InvalidArgumentError(f"{option.flag} is required (or set {option.env}).")
        else:
            return option.default
    sep = " " if source.startswith("--") else "="
    try:
        return option.convert(text)
    except InvalidArgumentError as exc:  # a converter that names the part of the value at fault
        raise InvalidArgumentError(f"{source}{sep}{shorten(text)}: {exc}") from None
    except (ValueError, TypeError):
        raise InvalidArgumentError(f"{source}{sep}{shorten(text)} must be {option.rule}.") from None


def resolve_all(
    options: Iterable[Option],
    args: argparse.Namespace,
    env: Mapping[str, str],
    fallback: Fallback | None = None,
) -> dict[str, Any]:
    """Every option's value by dest (see :func:`resolve`)."""
    return {o.dest: resolve(o, getattr(args, o.dest, None), env, fallback) for o in options}


# -- converters: each returns the value or raises ValueError (the option's rule says why) ---------


def integer(low: int, high: int | None = None) -> tuple[Callable[[str], int], str]:
    """A converter of whole numbers in ``low..high`` and its rule."""

    def convert(text: str) -> int:
        value = int(text.strip())
        if value < low or (high is not None and value > high):
            raise ValueError
        return value

    return convert, f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"


#: The rules of :func:`seconds` and :func:`nonnegative_seconds` in words (:mod:`.durations`).
SECONDS_RULE = durations.rule()
NONNEGATIVE_SECONDS_RULE = durations.rule(zero=True)


def seconds(text: str) -> float:
    """A number of seconds under :data:`SECONDS_RULE`."""
    return durations.duration(text)


def nonnegative_seconds(text: str) -> float:
    """A number of seconds under :data:`NONNEGATIVE_SECONDS_RULE`."""
    return durations.duration(text, zero=True)


def seconds_up_to(high: float) -> tuple[Callable[[str], float], str]:
    """A converter of finite seconds in ``0..high`` and its rule."""

    def convert(text: str) -> float:
        value = nonnegative_seconds(text)
        if value > high:
            raise ValueError
        return value

    return convert, f"a number of seconds in 0..{high:g}"


def nonempty(text: str) -> str:
    """Text with something in it, without surrounding blanks."""
    if not text.strip():
        raise ValueError
    return text.strip()


def switch(text: str) -> bool:
    """A switch's value: the flag given ("1"), or its variable as a boolean word."""
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off", ""):
        return False
    raise ValueError
