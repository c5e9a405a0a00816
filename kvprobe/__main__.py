from kvprobe.cli import main

raise SystemExit(main())
