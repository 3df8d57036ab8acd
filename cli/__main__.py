from orchestr.cli import main

raise SystemExit(main())
