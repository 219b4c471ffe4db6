"""What every rank of a run trains: the job a rank announces in ``Ready``."""

from __future__ import annotations

import attrs

from flodl.errors import ConfigError

__all__ = ["Job"]


@attrs.frozen
class Job:
    """Samples per epoch, batch size and number of epochs."""

    dataset_size: int
    batch_size: int
    epochs: int

    def problem(self) -> str | None:
        """Why this job cannot run (empty or inconsistent), or None when it can."""
        if self.batch_size < 1 or self.epochs < 1 or self.dataset_size < self.batch_size:
            return f"need batch_size >= 1, epochs >= 1 and dataset_size >= batch_size; got {self}"
        return None

    def check(self) -> Job:
        """This job, or ConfigError saying why it cannot run."""
        problem = self.problem()
        if problem is not None:
            raise ConfigError(problem)
        return self
