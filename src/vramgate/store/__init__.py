"""Storage: baseline files (readable JSON), atomic locked file writes (:mod:`vramgate.store.files`), and the
baselines a change moves."""
