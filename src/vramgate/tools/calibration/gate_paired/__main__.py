"""``python -m vramgate.tools.calibration.gate_paired``: the campaign's command line."""

from vramgate.tools.calibration.gate_paired.cli import main

raise SystemExit(main())
