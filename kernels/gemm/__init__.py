"""Matrix multiplication kernels (Hopper TMA + WGMMA, AMD gfx950 MFMA)."""
