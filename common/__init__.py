"""What the coordinator and the worker side share: the layer both import and that imports neither.

- :mod:`.errors`: the one error hierarchy and its gRPC status mapping.
- :mod:`.constants`: backends, the interface variables, event kinds, failure reasons.
- :mod:`.addresses`: host/port and IP-address text, parsed one way.
- :mod:`.interfaces`: the network-interface rules (pure), :mod:`.netinfo`: what this host has.
- :mod:`.tls`: TLS material and token files, one rule for both sides.
- :mod:`.messages`: the message types the client and the coordinator exchange, with proto conversion.
- :mod:`.client`: :class:`~.client.CoordinatorClient`, the one gRPC client of the coordinator.

Kept import-light: nothing here imports torch, the coordinator or the worker package.
"""
