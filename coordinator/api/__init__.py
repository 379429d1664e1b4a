"""The coordinator's edges: what turns requests into domain calls and back.

- :mod:`.validation`: every field of a request checked before any state changes.
- :mod:`.service`: the gRPC servicer (thin: translate, call the domain, answer).
- :mod:`.interceptor`: one wrapper for every RPC: authentication, error mapping, counting.
- :mod:`.events`: event streams and Join waiters (the asyncio side of the domain's events).
- :mod:`.views`: domain objects as proto and JSON views.
- :mod:`.http`: ``/metrics``, ``/sd``, ``/healthz``, ``/v1/jobs``; :mod:`.metrics`: the series.
"""
