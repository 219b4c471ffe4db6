"""The node agent (``flodl agent``): one process per host that starts, supervises and speaks
for that host's ranks, as torchrun's agent does.

:mod:`flodl.agent.config` is what it was asked to do, :mod:`flodl.agent.link` its connection to
the coordinator (and the exits it reports there), :mod:`flodl.agent.sessions` the ranks'
connections, which end at the agent (it speaks for them over that one connection),
:mod:`flodl.agent.host_ranks` the running of the host's ranks (shared with ``flodl run``, whose
link is the coordinator in its own process), :mod:`flodl.agent.agent` the process itself and
:mod:`flodl.agent.command` its flags.
"""
