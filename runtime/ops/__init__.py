"""Kernels the programs bind, by what they hold: torch references, C row ops, linear, attention, step tapes."""
