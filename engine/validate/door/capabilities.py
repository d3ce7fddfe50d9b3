"""Which capabilities an adapter has: what it implements in its protocol version's table (v1 or
v2), what it declares, and what a run checks and requires (`--require`). protocol.py and
protocol_v2.py define the tables; this module reads an adapter against them."""

from __future__ import annotations

from typing import Any, Collection, Mapping

from ..reports.report import ValidateError
from .guard import adapter_name, attribute
from .protocol import CAPABILITIES, implemented, missing_methods, protocol_version
from .protocol_v2 import CAPABILITIES_V2


def capability_table(adapter: Any) -> Mapping[str, tuple[str, ...]]:
    """Each capability's methods in the adapter's protocol version."""
    if protocol_version(adapter) == 2:
        return CAPABILITIES_V2
    return CAPABILITIES


def capabilities(adapter: Any, table: Mapping[str, tuple[str, ...]] | None = None) -> set[str]:
    """The capabilities whose every method the adapter defines (table: default the adapter's protocol's)."""
    return implemented(adapter, table or capability_table(adapter))


def declared_capabilities(adapter: Any) -> set[str] | None:
    """The adapter's `capabilities` attribute as a set of names, None when it has none."""
    declared = attribute(adapter, "capabilities")
    if declared is None:
        return None
    if isinstance(declared, str) or not isinstance(declared, Collection) or \
            not all(isinstance(c, str) for c in declared):
        raise ValidateError(f"adapter {adapter_name(adapter)}: `capabilities` must be a collection of "
                            f"names ({', '.join(CAPABILITIES)}), got {declared!r}")
    return _known(set(declared), f"adapter {adapter_name(adapter)} declares")


def _known(names: set[str], who: str) -> set[str]:
    unknown = sorted(names - set(CAPABILITIES))
    if unknown:
        raise ValidateError(f"{who} unknown capabilit{'ies' if len(unknown) > 1 else 'y'} "
                            f"{', '.join(unknown)} (known: {', '.join(CAPABILITIES)})")
    return names


def resolve_capabilities(adapter: Any, require: str | Collection[str] | None = None) -> tuple[set[str], set[str]]:
    """-> (run, required): the capabilities validate checks, and those whose checks must run.

    require: None or "declared" (the adapter's declaration, else what it implements), "none",
    or capability names (a collection, or one comma-separated string). ValidateError for an
    adapter that implements nothing, a partly implemented or a declared but missing
    capability (a v1 adapter declaring a protocol 2 one), and unknown names."""
    declared = declared_capabilities(adapter)
    name = adapter_name(adapter)
    table = capability_table(adapter)
    for cap in table:
        if declared is not None and cap in declared and not table[cap]:
            raise ValidateError(f"adapter {name} declares capability {cap!r}, which needs protocol 2 (paged KV: "
                                f"a protocol 1 adapter has no pages); set `protocol = 2` and implement "
                                f"{cap}() (engine/validate/door/protocol_v2.py)")
        missing = missing_methods(adapter, cap, table)
        if declared is not None and cap in declared and missing:
            raise ValidateError(f"adapter {name} declares capability {cap!r} but has no "
                                f"{', '.join(m + '()' for m in missing)}")
        if declared is None and 0 < len(missing) < len(table[cap]):
            present = [m + "()" for m in table[cap] if m not in missing]
            raise ValidateError(f"adapter {name} implements {', '.join(present)} of capability {cap!r} "
                                f"but not {', '.join(m + '()' for m in missing)}")
    run = capabilities(adapter, table)
    if not run:
        options = "; ".join(f"{cap}: {', '.join(methods)}" for cap, methods in table.items() if methods)
        raise ValidateError(f"adapter {name} implements no capability (each needs all of its methods: "
                            f"{options})")
    if require is None or require == "declared":
        required = declared if declared is not None else run
    elif require == "none":
        required = set()
    else:
        names = require.split(",") if isinstance(require, str) else list(require)
        required = _known({n.strip() for n in names if n.strip()}, "--require names")
        if not required:
            raise ValidateError("--require: expected capability names, `declared` or `none`")
    return run, set(required)
