from specdecode.cli import main

raise SystemExit(main())
