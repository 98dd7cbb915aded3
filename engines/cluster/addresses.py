"""Where a worker can be reached: this node's address and a free port.

Kept apart from the Ray worker groups so that a backend driven without Ray (the GPU benchmarks, a bare loop
on a machine without Ray installed) can still open its rendezvous points.
"""

from __future__ import annotations

import socket
import sys


def node_ip() -> str:
    """This node's address as Ray knows it (other nodes reach it there); loopback outside Ray."""
    ray = sys.modules.get("ray")  # never imported in this process: no Ray cluster to ask
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return LOOPBACK


LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free on every interface of this node (a rendezvous store listens on all of them)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
