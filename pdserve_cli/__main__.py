from pdserve_cli.main import main

raise SystemExit(main())
