"""What a round may reduce in: ``--average-dtype`` (``fp32``, or 16 bits: ``bf16``, ``fp16``).

A 16-bit round sends each rank's moves since the last round, not its parameters
(:mod:`flodl.backends.compressed`). Names only here, so settings can be checked without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["AVERAGE_DTYPE_NAMES", "reduce_dtype"]

AVERAGE_DTYPE_NAMES = ("fp32", "bf16", "fp16")
"""The names ``--average-dtype`` takes; ``fp32`` (the default) is a full-precision round."""


def reduce_dtype(name: str) -> torch.dtype | None:
    """The dtype a round named ``name`` reduces its moves in; None for a full-precision round.
    KeyError for a name not in :data:`AVERAGE_DTYPE_NAMES`."""
    import torch

    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
