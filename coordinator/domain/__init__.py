"""The membership domain: pure, no I/O, no gRPC, no SQLite, no asyncio; time from a :class:`clock.Clock`.

- :mod:`.model`: jobs, members, events (plain data).
- :mod:`.transitions`: the state diagram, the one place states change.
- :mod:`.ranks`: laying out a world (host-contiguous ranks, the master).
- :mod:`.liveness`: judging members (silence, stalls), finding who blocks.
- :mod:`.resent_joins`: what a Join sent again is answered with.
- :mod:`.elastic`: elastic worlds (MIN..MAX members, the last call, parked joins, re-rendezvous,
  closing), for torchrun's ``--nnodes MIN:MAX``.
- :mod:`.sweep`: applying the liveness rules to the jobs (broken streams, silent members, stalls).
- :mod:`.context`: what :mod:`.elastic` and :mod:`.sweep` may use of the membership.
- :mod:`.member_index`: the members that can act, by id (the report path's lookup).
- :mod:`.membership`: the operations (join, heartbeat, leave, fail, sweep) over the above, and the
  owner of the jobs and of the index of their members.

"Change how a failed peer is judged" is :mod:`.liveness`; the import contracts in
``pyproject.toml`` (``lint-imports``) hold that nothing here imports grpc, sqlite3 or asyncio.
"""
