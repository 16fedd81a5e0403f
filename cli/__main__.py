from pdserve.cli.main import main

raise SystemExit(main())
