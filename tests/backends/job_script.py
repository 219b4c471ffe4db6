"""Driver for the clean-exit test: many small 2-rank jobs, each rank a real process.

Not a test module. Imports torch once, then forks the two ranks of each job, so a job costs
milliseconds instead of seconds of imports; each rank forms a gloo group, averages once,
closes its backend and leaves through normal interpreter shutdown (``sys.exit``; never
``os._exit``), which is where live gloo groups abort the process (SIGABRT). Prints one JSON
line: the wait statuses of every rank. ``--no-close`` skips ``close()`` (to see the failure).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import trio

from flodl.averaging.kernels import warm_up
from flodl.backends.gloo import GlooBackend


async def rank_main(rank: int, info_read: int, info_write: int, close: bool) -> None:
    backend = GlooBackend(op_timeout=10.0, join_timeout=10.0, verify_every=1)
    if rank == 0:
        info = backend.prepare_group(0, "127.0.0.1")
        os.write(info_write, info.hex().encode() + b"\n")
    else:
        info = bytes.fromhex((await trio.to_thread.run_sync(os.read, info_read, 4096)).decode())
    await backend.join_group(info, rank, 2, 0)
    params = [torch.full((16,), float(rank + 1))]
    result = await backend.average(params, [], batches=1)
    if result.total_mass != 2.0 or not torch.equal(params[0], torch.full((16,), 1.5)):
        raise SystemExit(3)
    if close:
        await backend.close()


def run_rank(rank: int, info_read: int, info_write: int, close: bool) -> None:
    """Body of a forked rank: never returns into the driver loop."""
    gc.enable()
    code = 0
    try:
        trio.run(rank_main, rank, info_read, info_write, close)
    except SystemExit as exc:
        code = int(exc.code or 0)
    except BaseException as exc:
        print(f"rank {rank} failed: {exc!r}", file=sys.stderr)
        code = 2
    sys.exit(code)  # normal shutdown: static destructors run, as in a real rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--no-close", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Load the end-of-round loop once here, as torch is, rather than in every forked rank
    # (~0.5 s of CPU each): the ranks still exit with it loaded, as real ranks do.
    warm_up()
    # Keep the children from copying the parent's heap page by page at exit (Python docs'
    # advice for fork servers): freeze what is imported, collect nothing until forked.
    gc.disable()
    gc.freeze()
    statuses: list[int] = []
    started = 0
    while started < args.jobs:
        batch = min(args.concurrent, args.jobs - started)
        pids = []
        for _ in range(batch):
            info_read, info_write = os.pipe()
            for rank in (0, 1):
                pid = os.fork()
                if pid == 0:
                    run_rank(rank, info_read, info_write, not args.no_close)
                pids.append(pid)
            os.close(info_read)
            os.close(info_write)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            statuses.append(status)
        started += batch
    print(json.dumps({"statuses": statuses}))


if __name__ == "__main__":
    main()
