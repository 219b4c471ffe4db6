"""``flodl run``: the coordinator and the supervision of this host's ranks in one process, then
the summary, the account of what was saved and the failure report.

Rule: the top of the shell stack; nothing in flodl but ``flodl.cli`` imports it.
"""
