"""The gate's core: metrics and units, noise-aware statistics, the checks of one metric, claim verdicts.

Imports nothing of the project; everything else builds on it."""
