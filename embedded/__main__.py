from embedded.launcher import main

raise SystemExit(main())
