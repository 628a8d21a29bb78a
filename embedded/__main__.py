from embedded.command import main

raise SystemExit(main())
