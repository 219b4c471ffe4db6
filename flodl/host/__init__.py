"""This machine: the environment a rank starts with, the host layout, torchrun's variables,
hangups, the run folder, console printing.

Rule: imports nothing of ``flodl.coordinator``, ``flodl.launch``, ``flodl.observe`` or
``flodl.supervise``.
"""
