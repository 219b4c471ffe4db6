"""The decisions of flodl, sans-IO: pure code that takes events and the current time and returns
effects. No trio, no torch, no sockets, no clock of its own.

Rule: modules here import only the standard library, attrs, ``flodl.errors``, ``flodl.wire`` and
``flodl.core`` itself. ``core.common`` and ``core.cadence`` serve both protocol ends;
``core.coordinator`` and ``core.rank`` are the two ends and never import each other
(``tests/test_layers.py`` holds every rule).
"""
