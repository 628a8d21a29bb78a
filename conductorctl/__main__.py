from conductorctl.cli import main

raise SystemExit(main())
