"""What an average is: the mass rule, the flat buffers a round reduces, the fused kernels that
copy and measure them.

Rule: torch and numba only, no ``torch.distributed``; ``flodl.backends`` moves the tensors and
calls this for the arithmetic, so a new averaging rule (an outer optimizer, another weighting)
goes here, not into a backend. Importing this package imports no torch; its modules do.
"""
