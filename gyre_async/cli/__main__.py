from gyre_async.cli.main import main

raise SystemExit(main())
