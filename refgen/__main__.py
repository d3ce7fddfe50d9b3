"""`python -m refgen`: the same command as `refgen`."""

from .cli import main

main()
