"""What both protocol ends share: the averaging policy, the epoch order and its spans, the job,
the work a rank is handed.

Rule: imports nothing of ``core.cadence``, ``core.coordinator`` or ``core.rank``.
"""
