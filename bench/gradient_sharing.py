"""Can the slow rank count through gradients? A two-process experiment, not a flodl mode.

``python bench/gradient_sharing.py`` -> ``bench/results/gradient_sharing.json``.

The time-to-quality bench found that averaging moves every window turns a 2.5x-slower rank's
samples into almost nothing per step (docs/benchmarks.md, "Time to quality"). This measures two
ways of bringing them in as gradients instead, before building either into flodl, on the
``gpt`` workload at 2 ranks (the fast process and one 2.5x slower, one core each):

* ``solo``: the fast process alone, AdamW, batch 32 (the time-to-quality bench's solo).
* ``stale_w<w>`` (``--weights``): asynchronous SGD with bounded staleness. The fast process
  trains as solo; beside it the slow process computes one gradient at a time on the newest
  parameters the fast one sent it, then sleeps 1.5x that compute (2.5x slower, as the bench's
  slow rank). Whenever one has arrived, the fast step uses ``(own + w * slow) / (1 + w)`` in
  place of its own gradient and sends its parameters back. Pipes served by threads carry both
  directions, so neither process waits; the slow gradient is as stale as the fast steps taken
  while it was computed.
* ``balanced``: synchronous, with batches in proportion to speed (the slow process trains
  ``round(32 / factor)`` samples a step, so both finish a step together): every step the two
  exchange gradients and both apply the sample-weighted mean, so their parameters stay equal
  and each step holds ``32 + 13`` fresh samples.

Each run gets the same training budget on the fast process's :class:`BudgetClock`; repeats run
the variants in a rotated order; the JSON has every curve, the medians and, per run, the gain
per step over solo (solo's median loss at the run's step count less the run's loss).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from benchenv import load
from quality_task import BudgetClock, GptTask, sample_order

RESULT = Path(__file__).resolve().parent / "results" / "gradient_sharing.json"
STOP = b"stop"


class Newest:
    """The newest message put, taken at most once (older ones are dropped)."""

    def __init__(self) -> None:
        self._value: bytes | None = None
        self._changed = threading.Condition()

    def put(self, value: bytes) -> None:
        with self._changed:
            self._value = value
            self._changed.notify_all()

    def take(self, wait: bool) -> bytes | None:
        with self._changed:
            while wait and self._value is None:
                self._changed.wait()
            value, self._value = self._value, None
            return value


def read_into(conn: Connection, newest: Newest) -> None:
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return
        newest.put(message)
        if message == STOP:
            return


def write_from(conn: Connection, newest: Newest) -> None:
    while True:
        message = newest.take(wait=True)
        assert message is not None
        conn.send_bytes(message)
        if message == STOP:
            return


def serve(target: Any, *args: Any) -> None:
    threading.Thread(target=target, args=args, daemon=True).start()


def flat(tensors: Sequence[torch.Tensor]) -> bytes:
    return bytes(torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().tobytes())


def unflat(data: bytes, into: Sequence[torch.Tensor]) -> None:
    copy_flat(torch.frombuffer(bytearray(data), dtype=torch.float32), into)


def copy_flat(values: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for tensor in into:
            size = tensor.numel()
            tensor.copy_(values[offset : offset + size].view_as(tensor))
            offset += size


def batches(task: GptTask, rank: int, world: int) -> Iterator[torch.Tensor]:
    """Rank ``rank``'s slice of each epoch's shared order, a batch at a time."""
    epoch = 0
    while True:
        order = sample_order(task.dataset_size, epoch, 0)[rank::world]
        for start in range(0, len(order) - task.batch_size + 1, task.batch_size):
            yield order[start : start + task.batch_size]
        epoch += 1


def slow_process(factor: float, params_in: Connection, grads_out: Connection) -> None:
    """The stale variants' slow process: a gradient on the newest parameters, then a sleep."""
    torch.set_num_threads(1)
    task = GptTask(0)
    parameters = list(task.model.parameters())
    source = batches(task, 1, 2)
    params = Newest()
    serve(read_into, params_in, params)
    have = False
    while True:
        received = params.take(wait=not have)
        if received == STOP:
            return
        if received is not None:
            unflat(received, parameters)
            have = True
        started = time.perf_counter()
        task.model.zero_grad()
        task.loss(next(source)).backward()  # type: ignore[no-untyped-call]
        gradient = flat(gradients(parameters))
        spent = time.perf_counter() - started
        grads_out.send_bytes(gradient)
        time.sleep((factor - 1.0) * spent)


def balanced_peer(factor: float, grads_in: Connection, grads_out: Connection) -> None:
    """The balanced variant's slow process: a step of ``round(32 / factor)`` samples (slowed),
    the gradients exchanged, the same weighted step as the fast process."""
    torch.set_num_threads(1)
    task = GptTask(0, batch_size=round(32 / factor))
    parameters = list(task.model.parameters())
    source = batches(task, 1, 2)
    outgoing = Newest()
    serve(write_from, grads_out, outgoing)
    while True:
        started = time.perf_counter()
        task.optimizer.zero_grad()
        task.loss(next(source)).backward()  # type: ignore[no-untyped-call]
        time.sleep((factor - 1.0) * (time.perf_counter() - started))
        outgoing.put(flat(gradients(parameters)))
        other = grads_in.recv_bytes()
        if other == STOP:
            return
        mix_gradients(parameters, other, task.batch_size, 32)
        task.optimizer.step()


def gradients(parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in parameters if p.grad is not None]


def mix_gradients(
    parameters: Sequence[torch.Tensor], other: bytes, own_weight: float, other_weight: float
) -> None:
    """Set the gradients to the weighted mean of their own and ``other`` (flat float32). Two
    processes that mix each other's with swapped weights get equal results: a weighted sum of
    two terms is the same whichever comes first."""
    grads = gradients(parameters)
    own = torch.cat([grad.reshape(-1) for grad in grads])
    theirs = torch.frombuffer(bytearray(other), dtype=torch.float32)
    mean = (own_weight * own + other_weight * theirs) / (own_weight + other_weight)
    copy_flat(mean, grads)


def run(variant: str, budget: float, factor: float) -> dict[str, Any]:
    """One run of ``variant`` (``solo``, ``stale_w<w>`` or ``balanced``)."""
    torch.set_num_threads(1)
    task = GptTask(0)
    parameters = list(task.model.parameters())
    load_before = load()
    fork = multiprocessing.get_context("fork")
    to_peer, from_here = fork.Pipe()
    to_here, from_peer = fork.Pipe()
    weight = float(variant.removeprefix("stale_w")) if variant.startswith("stale_w") else None
    slow_batch = round(32 / factor)
    peer = None
    outgoing, incoming = Newest(), Newest()
    if variant != "solo":
        target = balanced_peer if variant == "balanced" else slow_process
        peer = fork.Process(target=target, args=(factor, from_here, from_peer))
        peer.start()
        serve(write_from, to_peer, outgoing)
        if weight is not None:
            serve(read_into, to_here, incoming)
            outgoing.put(flat(parameters))
    source = batches(task, 0, 1 if peer is None else 2)
    clock = BudgetClock(budget)
    clock.start()
    clock.evaluate(task.validation_loss, step=0)
    steps = used = 0
    while True:
        task.optimizer.zero_grad()
        task.loss(next(source)).backward()  # type: ignore[no-untyped-call]
        if variant == "balanced":
            outgoing.put(flat(gradients(parameters)))
            mix_gradients(parameters, to_here.recv_bytes(), 32, slow_batch)
            used += 1
        elif weight is not None:
            arrived = incoming.take(wait=False)
            if arrived is not None:
                mix_gradients(parameters, arrived, 1.0, weight)
                used += 1
                outgoing.put(flat(parameters))
        task.optimizer.step()
        steps += 1
        if clock.tick(task, step=steps):
            break
    if peer is not None:
        outgoing.put(STOP)
        peer.join(5)
        peer.kill()
    return {
        "variant": variant,
        "steps": steps,
        "slow_gradients_used": used,
        "loss_at_budget": clock.curve[-1]["loss"],
        "curve": clock.curve,
        "load_before": load_before,
        "load_after": load(),
    }


def loss_at_step(runs: Sequence[dict[str, Any]], step: int) -> float | None:
    """The median over ``runs`` of their loss at ``step`` (linear between evaluation points)."""
    found = []
    for result in runs:
        points = [(p["step"], p["loss"]) for p in result["curve"]]
        for (s0, l0), (s1, l1) in itertools.pairwise(points):
            if s0 <= step <= s1:
                found.append(l0 + (l1 - l0) * (step - s0) / max(1, s1 - s0))
                break
    return statistics.median(found) if found else None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--budget", type=float, default=40.0, help="training seconds per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--factor", type=float, default=2.5, help="how much slower rank 1 is")
    parser.add_argument("--weights", type=float, nargs="*", default=[1.0, 0.4])
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    variants = ["solo", *(f"stale_w{w:g}" for w in args.weights), "balanced"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for index in range(len(variants)):
            variant = variants[(index + repeat) % len(variants)]
            result = run(variant, args.budget, args.factor)
            runs[variant].append(result)
            print(
                f"{variant}: loss {result['loss_at_budget']:.4f}, {result['steps']} steps, "
                f"{result['slow_gradients_used']} slow gradients",
                file=sys.stderr,
            )
    for results in runs.values():
        for result in results:
            solo = loss_at_step(runs["solo"], result["steps"])
            result["gain_per_step"] = (
                None if solo is None else round(solo - result["loss_at_budget"], 4)
            )
    output = {
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": "gpt",
        "budget_s": args.budget,
        "factor": args.factor,
        "repeats": args.repeats,
        "median_loss_at_budget": {
            name: statistics.median(r["loss_at_budget"] for r in results)
            for name, results in runs.items()
        },
        "median_steps": {
            name: statistics.median(r["steps"] for r in results) for name, results in runs.items()
        },
        "runs": runs,
        "command": " ".join(["python bench/gradient_sharing.py", *(argv or sys.argv[1:])]),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=1) + "\n")
    print(json.dumps(output["median_loss_at_budget"]))


if __name__ == "__main__":
    main()
