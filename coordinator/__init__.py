"""The sarcomm coordinator: membership, liveness and discovery for SAR-style jobs.

Kept import-light on purpose: the worker side imports ``sarcomm.coordinator.errors`` and
``sarcomm.coordinator.interfaces`` without pulling in the server.
"""
