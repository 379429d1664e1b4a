"""The sarcomm coordinator: membership, liveness and discovery for SAR-style jobs.

Imports only the shared layer (``sarcomm.common``) and the generated code, never the worker side.
"""
