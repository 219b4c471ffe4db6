"""A plain torchrun script (no flodl in it): dumps its environment, then trains a DDP model
over its own ``init_process_group`` and checks the replicas agree. Used by
tests/e2e/test_torchrun_style.py under ``torchrun`` and under ``flodl run``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main(out: Path, train: bool) -> DistributedDataParallel | None:
    """Returns the model, for the caller to keep alive until ``os._exit`` (see below)."""
    rank = int(os.environ["RANK"])
    (out / f"env{rank}.json").write_text(json.dumps(dict(os.environ)))
    if not train:
        return None
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    torch.manual_seed(rank)  # different starts: DDP broadcasts rank 0's at construction
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        x = torch.full((8, 4), float(rank + step))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], g) for g in gathered)
    print(f"rank {rank}: replicas equal: {same}", flush=True)
    dist.destroy_process_group()
    if not same:
        sys.exit(3)
    return model


if __name__ == "__main__":
    kept = main(Path(sys.argv[1]), train=sys.argv[2:] == ["--train"])
    # DDP's reducer keeps the gloo group (and its worker threads) alive after
    # destroy_process_group, and neither may be torn down with those threads running: an
    # interpreter exit aborts at random (SIGABRT, "terminate called without an active
    # exception"), and freeing the model deadlocks at random (the group's destructor joins a
    # worker thread while holding the GIL, and that thread needs the GIL to free the last
    # all_gather's tensors). Under torchrun as under flodl run; leaving without either
    # teardown, the model still referenced, is the usual way out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
