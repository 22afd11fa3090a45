"""Lowering: per-target stage pipelines, binaries, the compile cache and launch."""
