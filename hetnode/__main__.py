from hetnode.cli import main

raise SystemExit(main())
