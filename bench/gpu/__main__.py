"""`python -m bench.gpu`: the benchmark of record on a real GPU (see bench/gpu/run.py)."""

import sys

from bench.gpu.run import main

sys.exit(main())
