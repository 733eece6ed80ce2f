from vramgate.cli import main

raise SystemExit(main())
