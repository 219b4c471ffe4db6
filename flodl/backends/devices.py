"""Which device a rank trains and averages on, checked when it joins, not at its first round.

NCCL averages on one GPU per rank, ``cuda:LOCAL_RANK`` (torchrun's convention): a rank whose
``LOCAL_RANK`` is past the GPUs torch sees, or whose model has a tensor elsewhere (CPU
parameters, a model split across GPUs, ``model.cuda()`` without a device on ranks 1..N, which
puts every rank on GPU 0), is refused at join with a :class:`~flodl.errors.ConfigError` that
says what to change. Gloo averages wherever the model is, as long as it is all on one device.

Every thread that touches CUDA tensors for the backend binds itself to the rank's device
first (:func:`bind_thread`): a fresh thread's current device is GPU 0, and leaving a
``torch.cuda.stream`` block or a device guard there makes a CUDA context on GPU 0 (about
0.5 GiB for every rank; an error on exclusive-process GPUs).

A training loop may step under a CUDA stream of its own; the backend's threads read the
parameters on theirs. :class:`StepBoundary` orders the two: the loop marks each batch's end
(an event on its current stream), and a round's thread makes its stream wait for the last mark
before it reads a parameter.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

import torch

from flodl.errors import ConfigError

P = ParamSpec("P")
T = TypeVar("T")


def gpu_for(local_rank: int, gpus: int) -> torch.device:
    """``cuda:local_rank``; ConfigError when this host has no such GPU (two ranks must never
    share one: NCCL fails or hangs)."""
    if gpus <= 0:
        raise ConfigError("the nccl backend needs a CUDA GPU; torch sees none")
    if not 0 <= local_rank < gpus:
        raise ConfigError(
            f"LOCAL_RANK {local_rank} has no GPU: torch sees {gpus} "
            f"(cuda:0..cuda:{gpus - 1}). Run at most {gpus} rank(s) on this host, one per GPU, "
            "or set CUDA_VISIBLE_DEVICES so each rank sees its own"
        )
    return torch.device("cuda", local_rank)


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and buffers, by their dotted names (what a round averages)."""
    return [*model.named_parameters(), *model.named_buffers()]


def check_model_devices(
    tensors: Iterable[tuple[str, torch.Tensor]], expected: torch.device | None, backend: str
) -> None:
    """ConfigError naming the first tensor that is not on ``expected`` (None: the device the
    first tensor is on: a model split across devices is refused too), with both devices."""
    first: tuple[str, torch.device] | None = None
    for name, tensor in tensors:
        device = tensor.device
        if expected is not None:
            if not same_device(device, expected):
                raise ConfigError(
                    f"{name} is on {device}, but the {backend} backend averages on {expected}: "
                    f"move the model there before joining (model.to({str(expected)!r}))"
                )
        elif first is None:
            first = (name, device)
        elif not same_device(device, first[1]):
            raise ConfigError(
                f"{name} is on {device} and {first[0]} on {first[1]}: the {backend} backend "
                "averages a model that lies on one device"
            )


def same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, where ``cuda`` without an index means the current GPU."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    index_a = torch.cuda.current_device() if a.index is None else a.index
    index_b = torch.cuda.current_device() if b.index is None else b.index
    return index_a == index_b


def bind_thread(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for other devices)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


class StepBoundary:
    """The training loop's last finished batch, as a CUDA event on the stream it ran on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event: Any = None  # torch.cuda.Event (untyped in the stubs)

    def mark(self, device: torch.device) -> None:
        """Training thread, at a batch's end: record where its stream has got to (nothing
        for a device that is not a GPU)."""
        if device.type != "cuda":
            return
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        with self._lock:
            self._event = event

    def wait(self, device: torch.device) -> None:
        """A backend thread bound to ``device``: its stream waits for the last mark (the
        optimizer step that wrote the parameters) before anything it queues next."""
        with self._lock:
            event = self._event
        if event is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(event)


def step_marker(backend: object, model: torch.nn.Module) -> Callable[[], None] | None:
    """What the training loop calls at each batch's end for ``backend`` (its ``steps``), or
    None where there is nothing to order (no GPU, or a backend without a boundary)."""
    steps = getattr(backend, "steps", None)
    device = next((t.device for _, t in named_tensors(model)), None)
    if not isinstance(steps, StepBoundary) or device is None or device.type != "cuda":
        return None
    return lambda: steps.mark(device)


def on_device(
    device: torch.device | None, fn: Callable[P, T], steps: StepBoundary | None = None
) -> Callable[P, T]:
    """``fn``, run with the calling thread bound to ``device`` first (:func:`bind_thread`)
    and, given ``steps``, its stream waiting for the training loop's last step."""
    if device is None or device.type != "cuda":
        return fn

    def bound(*args: P.args, **kwargs: P.kwargs) -> T:
        bind_thread(device)
        if steps is not None:
            steps.wait(device)
        return fn(*args, **kwargs)

    return bound
