"""Wire benchmark: codec cost against raw CBOR, Channel throughput against the raw transport.

Writes bench/results/wire.json and prints a short table. Every figure is the median of
``--repeats`` runs of about ``--seconds`` each.

1. Codec: messages/s for a Batch report through the full path (FrameEncoder.encode, then
   FrameDecoder.feed / next_message: framing, HMAC both ways, sequence check, hardened CBOR,
   field validation) and through raw ``cbor2.loads(cbor2.dumps(to_payload(msg)))``.
   ``codec_overhead_ratio`` = (full - raw) / raw in time per message (target <= 2).
2. Channel: one-way Batch reports/s from a rank Channel to a coordinator Channel (after a real
   handshake) over tcp, unix and memory, sender and receiver in one trio process.
3. Raw transport: the same number of messages of the same CBOR payload, 4-byte length prefix
   only, one send_all each; the receiver just counts bytes. ``tcp_channel_msgs_per_s`` is the
   headline (target >= 20,000 on one core).

Timing: each run records wall time (time.perf_counter) and this process's CPU time
(time.process_time). The machine may be shared, so rates are per CPU-second of this
single-threaded process (what one core does); wall-clock rates are recorded alongside. The
measured variant and its baseline alternate within each repeat, so slow drifts in background
load hit both alike; a ratio is the median of the per-repeat ratios. (The library's one-clock
rule is for flodl/, not for this bench.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import benchenv
import cbor2
import trio

from flodl.transports import connect, open_listener
from flodl.transports.channel import Channel
from flodl.transports.greeting import accept_rank, connect_rank
from flodl.wire.codec import FrameDecoder, FrameEncoder
from flodl.wire.messages import Batch, to_payload

KEY = b"wire-bench-session-key-012345678"
MESSAGE = Batch(
    rank=3,
    batch_ms=41.25,
    data_ms=2.5,
    step_count=123_456,
    batch_loss=0.693147,
    param_norm=17.5,
    sync_divergence=None,
)
RESULTS = Path(__file__).resolve().parent / "results" / "wire.json"
CODEC_TARGET = 2.0
TCP_TARGET = 20_000.0


class Timer:
    """Wall and CPU seconds of the enclosed block (set on exit)."""

    wall = 0.0
    cpu = 0.0

    def __enter__(self) -> Timer:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu


Run = Callable[[int], Timer]
"""``run(n)`` does n operations and returns how long they took."""


def size_for(run: Run, seconds: float) -> int:
    """An operation count that takes about ``seconds`` of CPU."""
    n = 100
    while (took := run(n).cpu) < 0.2:
        n *= 4
    return max(1, int(n * seconds / took))


def compare(measured: Run, baseline: Run, seconds: float, repeats: int) -> dict[str, float]:
    """Rates (ops per CPU-second and per wall-second) of both, alternating within repeats."""
    n_measured, n_baseline = size_for(measured, seconds), size_for(baseline, seconds)
    rows: list[tuple[float, float, float, float]] = []
    for _ in range(repeats):
        a, b = measured(n_measured), baseline(n_baseline)
        rows.append(
            (n_measured / a.cpu, n_baseline / b.cpu, n_measured / a.wall, n_baseline / b.wall)
        )
    return {
        "measured_per_cpu_s": statistics.median(r[0] for r in rows),
        "baseline_per_cpu_s": statistics.median(r[1] for r in rows),
        "measured_per_wall_s": statistics.median(r[2] for r in rows),
        "baseline_per_wall_s": statistics.median(r[3] for r in rows),
        "time_ratio": statistics.median(r[1] / r[0] for r in rows),
    }


def codec_full(n: int) -> Timer:
    encoder, decoder = FrameEncoder(KEY), FrameDecoder(KEY)
    encode, feed, next_message = encoder.encode, decoder.feed, decoder.next_message
    message = MESSAGE
    with Timer() as timer:
        for _ in range(n):
            feed(encode(message))
            next_message()
    return timer


def codec_raw(n: int) -> Timer:
    dumps, loads, message = cbor2.dumps, cbor2.loads, MESSAGE
    with Timer() as timer:
        for _ in range(n):
            loads(dumps(to_payload(message)))
    return timer


async def channel_pair(url: str) -> tuple[Channel, Channel, Callable[[], Awaitable[None]]]:
    """A rank channel and the coordinator's channel for it, after a real handshake."""
    listener = await open_listener(url)
    accepted: list[Channel] = []

    async def coordinator() -> None:
        _, channel = await accept_rank(await listener.accept(), KEY, 1, taken=lambda _r: False)
        accepted.append(channel)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(coordinator)
        rank = await connect_rank(await connect(listener.url), KEY, 0, 1)

    async def close() -> None:
        await rank.aclose()
        await accepted[0].aclose()
        await listener.aclose()

    return rank, accepted[0], close


async def channel_one_way(url: str, n: int) -> Timer:
    rank, coordinator, close = await channel_pair(url)
    message = MESSAGE

    async def send() -> None:
        for _ in range(n):
            await rank.send(message)

    async def receive() -> None:
        for _ in range(n):
            await coordinator.receive()

    with Timer() as timer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            nursery.start_soon(send)
    await close()
    return timer


async def raw_one_way(url: str, n: int) -> Timer:
    listener = await open_listener(url)
    payload = cbor2.dumps(to_payload(MESSAGE))
    chunk = len(payload).to_bytes(4, "little") + payload
    total = n * len(chunk)
    async with trio.open_nursery() as nursery:
        server: list[trio.abc.Stream] = []

        async def take() -> None:
            server.append(await listener.accept())

        nursery.start_soon(take)
        client = await connect(listener.url)
    receiver = server[0]

    async def send() -> None:
        for _ in range(n):
            await client.send_all(chunk)

    async def receive() -> None:
        got = 0
        while got < total:
            got += len(await receiver.receive_some(64 * 1024))

    with Timer() as timer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            nursery.start_soon(send)
    await client.aclose()
    await receiver.aclose()
    await listener.aclose()
    return timer


def transport_urls(tmp: str) -> dict[str, Callable[[], str]]:
    counter = iter(range(1_000_000))
    return {
        "tcp": lambda: "tcp://127.0.0.1:0",
        "unix": lambda: f"unix://{tmp}/b{next(counter)}.sock",
        "memory": lambda: f"memory://wire-bench-{next(counter)}",
    }


def environment() -> dict[str, object]:
    return benchenv.environment(
        ("trio", "cbor2", "attrs", "flodl"),
        cbor2_compiled=cbor2.loads.__module__ != "cbor2._decoder",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="flodl wire benchmark")
    parser.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="median of this many")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    seconds, repeats = args.seconds, args.repeats

    codec_rates = compare(codec_full, codec_raw, seconds, repeats)
    full, raw = codec_rates["measured_per_cpu_s"], codec_rates["baseline_per_cpu_s"]
    total = round(codec_rates["time_ratio"], 3)  # full time / raw time
    overhead = round(total - 1, 3)  # (full - raw) / raw
    codec: dict[str, object] = {
        "message": "Batch",
        "payload_bytes": len(cbor2.dumps(to_payload(MESSAGE))),
        "frame_bytes": len(FrameEncoder(KEY).encode(MESSAGE)),
        "full_msgs_per_s": round(full),
        "raw_cbor_msgs_per_s": round(raw),
        "full_us_per_msg": round(1e6 / full, 3),
        "raw_us_per_msg": round(1e6 / raw, 3),
        "full_msgs_per_wall_s": round(codec_rates["measured_per_wall_s"]),
        "raw_cbor_msgs_per_wall_s": round(codec_rates["baseline_per_wall_s"]),
        "codec_overhead_ratio": overhead,
        "codec_total_ratio": total,
    }

    transports: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="flodl-bench-") as tmp:
        for name, make_url in transport_urls(tmp).items():

            def via_channel(n: int, make_url: Callable[[], str] = make_url) -> Timer:
                return trio.run(channel_one_way, make_url(), n)

            def via_raw(n: int, make_url: Callable[[], str] = make_url) -> Timer:
                return trio.run(raw_one_way, make_url(), n)

            rates = compare(via_channel, via_raw, seconds, repeats)
            transports[name] = {
                "channel_msgs_per_s": round(rates["measured_per_cpu_s"]),
                "raw_msgs_per_s": round(rates["baseline_per_cpu_s"]),
                "channel_over_raw": round(1 / rates["time_ratio"], 3),
                "channel_msgs_per_wall_s": round(rates["measured_per_wall_s"]),
                "raw_msgs_per_wall_s": round(rates["baseline_per_wall_s"]),
            }

    tcp_rate = transports["tcp"]["channel_msgs_per_s"]
    env = environment()
    result: dict[str, object] = {
        "codec": codec,
        "transports": transports,
        "codec_overhead_ratio": overhead,
        "codec_total_ratio": total,
        "tcp_channel_msgs_per_s": tcp_rate,
        "targets": {
            "codec_overhead_ratio_max": CODEC_TARGET,
            "codec_overhead_ok": overhead <= CODEC_TARGET,
            "tcp_channel_msgs_per_s_min": TCP_TARGET,
            "tcp_channel_ok": tcp_rate >= TCP_TARGET,
        },
        "method": {
            "seconds_per_measurement": seconds,
            "repeats": repeats,
            "statistic": "median",
            "rates": "per CPU-second of this process (time.process_time); *_per_wall_s: "
            "time.perf_counter",
        },
        "environment": env,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")

    print(f"codec, Batch ({codec['frame_bytes']}-byte frame, {codec['payload_bytes']}-byte CBOR)")
    print(f"  full path   {full:>10,.0f} msg/s  {1e6 / full:>7.2f} us")
    print(f"  raw CBOR    {raw:>10,.0f} msg/s  {1e6 / raw:>7.2f} us")
    print(f"  overhead    {overhead:.2f}x of raw (target <= {CODEC_TARGET:g}), total {total:.2f}x")
    print(f"{'transport':<10} {'channel msg/s':>14} {'raw msg/s':>12} {'ratio':>6}  (per CPU-s)")
    for name, row in transports.items():
        print(
            f"{name:<10} {row['channel_msgs_per_s']:>14,.0f} {row['raw_msgs_per_s']:>12,.0f}"
            f" {row['channel_over_raw']:>6.2f}"
        )
    verdict = "met" if tcp_rate >= TCP_TARGET else "MISSED"
    print(f"tcp channel target >= {TCP_TARGET:,.0f} msg/s: {verdict}")
    print(f"load average {env['load_average_1m']} on {os.cpu_count()} cpus; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
