"""The rank's machine (:class:`~flodl.core.rank.machine.RankMachine`): the same protocol seen
from a rank, with its state table, effects, batches, times, reports and averages.

Rule: imports ``core.common``, never ``core.coordinator`` or ``core.cadence``.
"""
