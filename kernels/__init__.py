"""Kiln's kernel library, written with the public DSL only."""
