"""Kiln's bottom layer: the target model of arch families, dtypes, errors and environment
settings. Every other layer may import it; it imports no other Kiln layer."""

__version__ = "0.1.0"  # kiln.__version__ (the facade re-exports it)
