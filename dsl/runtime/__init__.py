"""Kiln's runtime layer: launching compiled binaries, bound launches, argument marshalling and
the compile cache."""
