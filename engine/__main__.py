"""`python -m engine` runs the `kdtree` command line."""

from .cli import main

main()
