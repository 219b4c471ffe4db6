"""ElChe, the cadence: how many batches each rank runs between two averages, calibrated from
its measured speed, with the anchor auto-tuned and guarded by the divergence of each round.

Rule: imports only ``core.common`` of core; the coordinator machine drives it, never the reverse.
"""
