"""The CPU interpreter: runs Kiln IR on numpy, one CTA at a time, with race and bounds checks."""
