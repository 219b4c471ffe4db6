"""The coordinator's machine (:class:`~flodl.core.coordinator.machine.CoordinatorMachine`) and
everything only it uses: membership, rendezvous, rounds, liveness, dispatch, saves, the
ending, its timeline, and what it publishes (:class:`~flodl.core.coordinator.record.RunRecord`).

Rule: imports ``core.common`` and ``core.cadence``, never ``core.rank``.
"""
