"""Kiln's own MLIR passes (Python-defined), registered by name for pipelines and ``kiln-opt``."""
