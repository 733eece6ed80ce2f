"""Operations tools: the ``vramgate`` command line, the engine installer, the gate's calibration."""
