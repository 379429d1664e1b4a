"""``sar-coordinator`` with ``--leader-ttl`` unbounded, as the flag was before it had a bound.

The bound (1..MAX_LEADER_TTL) keeps the real command from handing the leader election a lease etcd
refuses or protobuf cannot carry; this lifts it, and nothing else, so that tests reach the
election's failure path with a real etcd: the coordinator must then stop with one line. Runs
``sarcomm.coordinator.cli.main`` with this script's arguments.
"""

from __future__ import annotations

import dataclasses
import sys

from sarcomm.coordinator import cli
from sarcomm.coordinator.storage import etcd_config

setattr(etcd_config, "MAX_LEADER_TTL", 10**40)  # noqa: B010 (EtcdSettings' own check)
# The flag's parse-time check: its Option row converts with int instead.
cli.SERVER_OPTIONS = tuple(
    dataclasses.replace(o, convert=int) if o.flag == "--leader-ttl" else o for o in cli.SERVER_OPTIONS
)

if __name__ == "__main__":
    sys.exit(cli.main())
