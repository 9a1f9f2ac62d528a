"""Run the fake vLLM server: ``python -m testkit.fake_server --port 8118 [options]``."""

from __future__ import annotations

import sys

from testkit.fake_server.cli import main

sys.exit(main())
