"""`python -m engine` runs the `kdtree` command line (Ctrl-C while it loads: exit 130, quietly)."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:
    sys.exit(130)

main()
