from kvprobe.cli.main import main

raise SystemExit(main())
