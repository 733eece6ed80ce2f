"""Tensor-parallel runs as real process groups: the launcher (no torch) and the rank worker."""
