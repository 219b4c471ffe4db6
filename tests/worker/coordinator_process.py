"""A coordinator in its own process, for tests that must freeze or kill it. Not a test.

``python -m tests.worker.coordinator_process WORLD_SIZE POLICY HEARTBEAT_TIMEOUT`` with the
session key (hex) in ``FLODL_SESSION_KEY``; prints ``url <URL>`` once listening, then
coordinates until the run ends.
"""

from __future__ import annotations

import sys

import trio

from flodl.config import CoordinatorConfig, Policy, session_key_from_env
from flodl.coordinator.server import open_coordinator


async def main(world_size: int, policy: str, heartbeat_timeout: float) -> None:
    config = CoordinatorConfig(
        policy=Policy(policy),
        heartbeat_timeout=heartbeat_timeout,
        heartbeat_interval=heartbeat_timeout / 6,
    )
    key = session_key_from_env()
    async with open_coordinator("tcp://127.0.0.1:0", world_size, key, config) as coordinator:
        print(f"url {coordinator.url}", flush=True)
        await coordinator.wait_finished()


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
