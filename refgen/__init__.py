"""refgen: the numpy float64 oracle (model, DDTree stages, decode loops) and the
golden fixtures it writes (`refgen generate`, slim as committed; `refgen materialize`,
full; `refgen verify`)."""

__version__ = "0.1.0"
