"""Storage: baseline files (readable JSON, atomic locked writes) and the baselines a change moves."""
