"""Rank processes and their exits: start, relay, restart, kill; knows nothing of the coordinator.

A supervisor reports each exit of a rank's process as a :class:`~flodl.supervise.exits.RankExit`
to an :class:`~flodl.supervise.exits.ExitSink`: the coordinator's shell when both run in one
process (``flodl run``), a channel to the coordinator for a supervisor on another host. It
imports nothing of ``flodl.coordinator``, ``flodl.launch`` or ``flodl.observe``.
"""
