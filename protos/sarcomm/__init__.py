"""sarcomm: start-up, health and measurement for SAR-style distributed PyTorch training.

``sarcomm.coordinator`` is the head-node daemon, ``sarcomm.worker`` the agent and the library
that training code imports, ``sarcomm.v1`` the generated gRPC code.
"""

from __future__ import annotations

__version__ = "0.1.0"
