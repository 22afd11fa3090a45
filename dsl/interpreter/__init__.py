"""Kiln's CPU interpreter: runs a kernel's GPU IR lane by lane, checking races, bounds and waits."""
