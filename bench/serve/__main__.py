"""``python -m bench.serve ARGS``: the same as ``kvmesh bench serve ARGS``."""

import sys

from bench.serve.command import main

sys.exit(main())
