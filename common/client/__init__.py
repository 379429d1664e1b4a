"""The one gRPC client of the coordinator, both sides' way in.

Layers, each on the one below:

- :mod:`.reach`: whether an address answers at all (the cause named in seconds).
- :mod:`.channel`: one gRPC channel with TLS, token and the retry policy (:mod:`.failover` says
  which codes mean "try another replica").
- :mod:`.replicas`: a list of replicas (one address is a list of one), following the leader.
- :mod:`.heartbeats`: the heartbeat stream and its reconnection.
- :mod:`.coordinator_client`: :class:`CoordinatorClient`, the calls a worker or a tool makes.
"""

from sarcomm.common.client.coordinator_client import CoordinatorClient as CoordinatorClient
