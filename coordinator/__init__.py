"""The sarcomm coordinator: membership, liveness and discovery for SAR-style jobs.

Imports only the shared layer (``sarcomm.common``) and the generated code, never the worker side.
Rooms, each a layer that imports only those below it (``pyproject.toml``'s import contracts):

- :mod:`.domain`: the membership state machine, pure (no I/O, no asyncio; time from a clock).
- :mod:`.storage`: where state lives, behind one boundary (SQLite, etcd), and the write-behind.
- :mod:`.api`: the edges: validation, the gRPC servicer, the interceptor, HTTP, metrics.
- :mod:`.term`: one leadership term (a membership with its writes, events, service and sweeper).
- :mod:`.ha`: a coordinator's seat (sole, or a replica on etcd) and the router that serves calls.
- :mod:`.server`, :mod:`.cli`, :mod:`.config`, :mod:`.status`: the process, its flags and the
  ``status`` command.
"""
