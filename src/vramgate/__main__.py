from vramgate.tools.cli import main

raise SystemExit(main())
