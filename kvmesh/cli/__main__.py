"""``python -m kvmesh.cli ARGS``: the ``kvmesh`` command (what benchmarks start as a subprocess)."""

import sys

from kvmesh.cli import main

sys.exit(main())
