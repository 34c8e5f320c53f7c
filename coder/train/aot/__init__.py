"""Ahead-of-time analysis of compiled programs: XLA's HLO statistics and the TPU chip table."""
