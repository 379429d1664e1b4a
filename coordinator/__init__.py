"""The sarcomm coordinator: membership, liveness and discovery for SAR-style jobs.

Imports only the shared layer (``sarcomm.common``) and the generated code, never the worker side.

The domain, pure (no I/O, no asyncio, time from a :class:`clock.Clock`): :mod:`model` (jobs,
members, events), :mod:`transitions` (the state diagram, the one place states change),
:mod:`ranks` (laying out a world), :mod:`liveness` (judging members, finding stalls),
:mod:`membership` (the operations). Storage: :mod:`store` (the boundary and SQLite),
:mod:`records` (the stored form), :mod:`persistence` (coalesced writes). Serving:
:mod:`validation`, :mod:`service`, :mod:`events` (streams and join waiters), :mod:`views`,
:mod:`interceptor`, :mod:`http`, :mod:`metrics`, :mod:`server`, :mod:`cli`, :mod:`status`.
"""
