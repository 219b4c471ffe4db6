"""A rank process for the backend tests: JSON-line commands and replies on a Unix socket.

Not a test module. Model: params p0 (3,) and p1 (2, 2); buffers b0 float (2,) and b1 an int64
step counter. Run: ``python tests/backends/rank_script.py --control SOCKET --op-timeout 3
[--bucket-elements N]``; it connects to ``SOCKET`` and first says it is ready, with its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
import trio

from flodl.backends import AverageResult, open_backend
from flodl.errors import BackendError, CollectiveAborted


class Model:
    def __init__(self) -> None:
        self.params = [torch.zeros(3), torch.zeros(2, 2)]
        self.buffers = [torch.zeros(2), torch.zeros((), dtype=torch.int64)]

    def fill(self, param: float, buffer: float, counter: int) -> None:
        for p in self.params:
            p.fill_(param)
        self.buffers[0].fill_(buffer)
        self.buffers[1].fill_(counter)

    def state(self) -> dict[str, Any]:
        tensors = [*self.params, self.buffers[0]]  # the int counter stays local: not compared
        return {
            "params": [p.reshape(-1).tolist() for p in self.params],
            "buffers": [b.reshape(-1).tolist() for b in self.buffers],
            "hex": b"".join(t.numpy().tobytes() for t in tensors).hex(),
        }


def result_dict(result: AverageResult) -> dict[str, Any]:
    return {
        "divergence": result.divergence,
        "pre_norm": result.pre_norm,
        "post_norm": result.post_norm,
        "skipped": result.skipped,
        "total_mass": result.total_mass,
        "movers": result.movers,
    }


async def serve(control: str, op_timeout: float, bucket_elements: int | None) -> None:
    stream = await trio.open_unix_socket(control)
    backend = open_backend(
        "auto",
        op_timeout=op_timeout,
        join_timeout=20.0,
        verify_every=1,  # the tests verify every round
        bucket_elements=bucket_elements,
    )
    model = Model()
    await reply(stream, {"ready": True, "backend": backend.name, "pid": os.getpid()})
    try:
        async for line in lines(stream):
            cmd = json.loads(line)
            out = await handle(backend, model, cmd)
            await reply(stream, out)
            if cmd["cmd"] == "close":
                return
    finally:
        await backend.close()
        await stream.aclose()


async def lines(stream: trio.SocketStream) -> AsyncIterator[bytes]:
    """The lines ``stream`` brings, until it ends."""
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            yield line


async def handle(backend: Any, model: Model, cmd: dict[str, Any]) -> dict[str, Any]:
    kind = cmd["cmd"]
    if kind == "prepare":
        return {"info": backend.prepare_group(cmd["generation"], "127.0.0.1").hex()}
    if kind == "join":
        start = time.monotonic()
        await backend.join_group(
            bytes.fromhex(cmd["info"]), cmd["rank"], cmd["world"], cmd["generation"]
        )
        return {"ok": True, "ms": (time.monotonic() - start) * 1e3}
    if kind == "fill":
        model.fill(cmd["param"], cmd["buffer"], cmd["counter"])
        return {"ok": True}
    if kind == "average":
        start = time.monotonic()
        status, result = "cancelled", None
        with trio.move_on_after(cmd.get("cancel_after", 1e9)):
            try:
                res = await backend.average(
                    model.params, model.buffers, cmd["batches"], cmd.get("gamma", 1.0)
                )
                status, result = "ok", result_dict(res)
            except CollectiveAborted as err:
                status, result = "aborted", {"error": str(err)}
        return {
            "status": status,
            "result": result,
            "ms": (time.monotonic() - start) * 1e3,
            "broken": backend.broken,
            **model.state(),
        }
    if kind == "background":
        async with trio.open_nursery() as nursery:
            pending = await backend.start_background_average(
                nursery, model.params, model.buffers, cmd["batches"], cmd.get("gamma", 1.0)
            )
            for p in model.params:  # "training" while the collective is in flight
                p.add_(cmd["train_delta"])
            await pending.wait()
            res = pending.blend_into(model.params, model.buffers, cmd.get("alpha", 0.5))
        return {"status": "ok", "result": result_dict(res), **model.state()}
    if kind == "close":
        await backend.close()
        return {"ok": True}
    raise BackendError(f"unknown command {kind!r}")


async def reply(stream: trio.SocketStream, obj: dict[str, Any]) -> None:
    await stream.send_all((json.dumps(obj) + "\n").encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", required=True, help="the harness's Unix socket")
    parser.add_argument("--op-timeout", type=float, default=3.0)
    parser.add_argument("--bucket-elements", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trio.run(serve, args.control, args.op_timeout, args.bucket_elements)


if __name__ == "__main__":
    main()
