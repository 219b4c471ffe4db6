"""flodl: data-parallel training for machines of unequal speed.

Importing flodl is light: torch is imported only by the modules that average parameters.
"""

from flodl.errors import FlodlError

__all__ = ["FlodlError", "__version__"]

__version__ = "0.1.0"
