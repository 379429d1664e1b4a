"""The ``sar-worker`` agent: registers a host's ranks, starts them, heartbeats, stops them.

Torch-free (an import contract in ``pyproject.toml`` holds it): the agent runs on hosts and in
containers where importing torch costs seconds and memory it does not need.

- :mod:`.cli`: flags and variables to an :class:`.config.AgentConfig` (``sar-worker``).
- :mod:`.decisions`: what to do on each event, pure (state and event in, actions out).
- :mod:`.events`: the decisions' events and actions.
- :mod:`.supervisor`: the I/O around the decisions: joins, the ranks, carrying out the actions;
  :mod:`.event_sources`: the heartbeat stream, signals and rank exits turned into events;
  :mod:`.local_rank`: one local rank as the agent sees it, and its heartbeat report.
- :mod:`.rank_process`, :mod:`.rankexec`: starting one rank and cleaning its whole tree.
- :mod:`.output`: rank output, tagged and teed; :mod:`.runner`: exit codes.
- :mod:`.bench`: ``sar-worker bench`` (its ranks run :mod:`sarcomm.worker.library.bench_rank`).
"""
