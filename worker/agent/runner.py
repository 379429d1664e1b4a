"""Running the ``sar-worker`` agent to its end from a command: the exit statuses and the one-line
messages (the ``sar-worker`` command and subcommands that run ranks, such as ``bench``, share it)."""

from __future__ import annotations

import asyncio
import sys

from sarcomm.common.errors import InvalidArgumentError, SarcommError
from sarcomm.worker.agent.config import AgentConfig
from sarcomm.worker.agent.supervisor import Agent

__all__ = ["EXIT_COORDINATOR", "EXIT_USAGE", "run_agent"]

#: Exit status for bad flags, variables or settings.
EXIT_USAGE = 2
#: Exit status when the coordinator refused the job or could not be reached.
EXIT_COORDINATOR = 1


def run_agent(config: AgentConfig) -> int:
    """Run the agent to its end and return ``sar-worker``'s exit status, printing its one-line
    error or failure message (subcommands that run ranks, such as ``bench``, use it too)."""
    try:
        result = asyncio.run(Agent(config).run())
    except InvalidArgumentError as exc:
        print(f"sar-worker: error: job {config.job}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SarcommError as exc:
        print(f"sar-worker: error: job {config.job}: {exc}", file=sys.stderr)
        return EXIT_COORDINATOR
    except KeyboardInterrupt:
        print(f"sar-worker: job {config.job}: interrupted before the ranks started", file=sys.stderr)
        return 130
    if result.message:
        print(f"sar-worker: {result.message}", file=sys.stderr)
    return result.exit_code
