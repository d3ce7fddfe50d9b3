"""The KdtrError family: every problem with a KDTR file or a fixture config."""


class KdtrError(Exception):
    """Base of every error this package raises on bad input."""
