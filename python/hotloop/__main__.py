from hotloop.cli import main

raise SystemExit(main())
