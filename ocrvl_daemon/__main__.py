"""`python -m ocrvl_daemon` is `ocrvl`."""

from ocrvl_daemon.cli import main

raise SystemExit(main())
