"""The one gRPC client of the coordinator, both sides' way in.

Layers, each on the one below:

- :mod:`.reach`: whether an address answers at all (the cause named in seconds).
- :mod:`.channel`: :class:`~.channel.Channels`, one gRPC channel per address (TLS, token,
  keepalive, no gRPC retries), and what a failed call means.
- :mod:`.failover`: which replica the next try goes to, and after how long (pure).
- :mod:`.replicas`: :class:`~.replicas.Replicas`, the addresses as one list (one address is a list
  of one), following the leader: its ``call`` is the client's one retry layer.
- :mod:`.heartbeats`: the heartbeat stream and its reconnection, over a ``Replicas``;
  :mod:`.by_exception`: what a stream reporting by exception sends (pure).
- :mod:`.watch`: the Watch stream of a job's events, re-attaching at the leader, over a ``Replicas``.
- :mod:`.join`: a Join's request (its fields checked) and its answer as a ``JoinResult`` (no I/O).
- :mod:`.coordinator_client`: :class:`CoordinatorClient`, the calls a worker or a tool makes; it
  has a ``Replicas`` (composition, not inheritance).
"""

from sarcomm.common.client.coordinator_client import CoordinatorClient as CoordinatorClient
