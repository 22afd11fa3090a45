"""NVIDIA instruction families, one module each: how an op is emitted, which chips have it, its
declared effects and its interpreter semantics."""
