"""Child of test_crash.py: save bundles in a loop until killed.

Usage: crash_saver.py DIRECTORY FIRST_STEP. Prints "ready" once torch is loaded and the
tensors are built, then "saved <step>" after each save returns. Every tensor of the bundle for
step s holds the value s (optimizer tensors -s), so a bundle mixing two saves is detectable.
Stems rotate over three slots, so saves also overwrite earlier bundles.
"""

from __future__ import annotations

import sys
import time

import torch

from flodl.checkpoint import CheckpointMeta, save_bundle

TENSORS = 4
SHAPE = (512, 1024)  # 2 MiB of float32 per tensor: a save takes a while


def main() -> None:
    directory, first_step = sys.argv[1], int(sys.argv[2])
    model = {f"layer{i}.weight": torch.empty(SHAPE) for i in range(TENSORS)}
    momentum = {i: {"momentum_buffer": torch.empty(SHAPE)} for i in range(TENSORS)}
    print("ready", flush=True)
    step = first_step
    while True:
        for t in model.values():
            t.fill_(float(step))
        for per_param in momentum.values():
            per_param["momentum_buffer"].fill_(-float(step))
        meta = CheckpointMeta(
            epoch=0,
            global_step=step,
            sync_round=step,
            world_size_at_save=2,
            save_reason="CHECKPOINT",
            elche_state=None,
            guard_state=None,
            created_unix=time.time(),
            flodl_version="test",
        )
        save_bundle(
            directory,
            f"slot{step % 3}",
            model_state=model,
            optimizer_state={
                "state": momentum,
                "param_groups": [{"lr": 0.1, "params": list(range(TENSORS))}],
            },
            meta=meta,
        )
        print(f"saved {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
