"""Resume helpers: fit a saved ElChe to the world size of the resumed run (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flodl.core.elche import ElChe
from flodl.errors import ConfigError

__all__ = ["elche_for_world"]


def elche_for_world(state: Mapping[str, Any], world_size: int) -> ElChe:
    """The saved ElChe, fitted to ``world_size`` ranks.

    Ranks are matched by index: rank ``i`` of the resumed run inherits rank ``i``'s timings.
    The anchor, its bounds, the calibration count (hence the phase) and the growth latch are
    kept in every case.

    - Same size: exactly the saved ElChe.
    - Fewer ranks: ranks ``world_size..`` are dropped as by :meth:`ElChe.for_survivors`; if the
      anchor rank was among them, the slowest timed survivor becomes the anchor rank, and the
      counts are recomputed from the kept timings.
    - More ranks: new ranks are appended as by :meth:`ElChe.add_rank`; they have no timing and
      run ``anchor`` batches until their first report.

    Raises:
        CheckpointError: ``state`` is malformed or from a newer ElChe.
        ConfigError: ``world_size`` < 1.
    """
    if world_size < 1:
        raise ConfigError(f"cannot resume with world size {world_size}; it must be >= 1")
    elche = ElChe.from_state(state)
    if world_size < elche.world_size:
        return elche.for_survivors(range(world_size))
    while elche.world_size < world_size:
        elche.add_rank()
    return elche
