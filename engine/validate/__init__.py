"""`kdtree validate`: check an implementation against the golden fixtures.

Sections of the report, each a list of `Check` rows:

1. Model fixtures (`<preset>.kdtr`), through the adapter protocol
   (door/protocol.py; rows/model.py): prefill logits and verify logits within the fixture's
   tolerance (the worst error and its tolerance reported); AR tokens, tree
   build, target choices, accept and committed tokens exact; for sampled
   traces the adapter's sample_accept with the fixture's uniforms, and the
   fixture's adversarial sampling cases, exact. A token that differs is
   reported with the fixture's margin at that decision: below the fixture's
   margin_threshold it is a near-tie (reported, not a failure), above it a
   FAIL. Traces are replayed teacher-forced: each round takes the fixture's
   start, root, draft and tree, so one wrong round cannot hide the rest.
2. Engine decode (the built-in engine only, rows/engine.py): `engine.decode`
   batched over the fixture's prompts (AR) and traces (DDTree with the replay
   drafter and, for sampled traces, the recorded uniforms: every round's tree,
   choices and acceptance exact, whole token sequences equal), each batch
   holding requests of different prompts, budgets and lengths; and what its
   decode loop decides alone: the uniforms its own sampling draws (fresh every
   round), its greedy choice on tied logits (the smaller id, across the
   vocabulary shards under TP), and in invariant mode a token's logits bit for
   bit whatever the rows of its forward.
3. Kernel cases (`kernels/*.kdtr`): top-k from draft logits, tree build
   (float64 scores too) and compile (positions, visibility bits, EAGLE links)
   bit-exact from the given top-k, accept and compaction exact (the whole
   cache), verify attention within tolerance (every request of a case); paged KV (`kernels/paged_kv.kdtr`, protocol v2
   only: rows/paged.py): verify attention and compaction through a block table.
4. The invariant (the built-in engine only): DDTree greedy == AR greedy for
   every preset, with the oracle, random and layerskip drafters: on each model
   fixture's weights and prompts, and on seeded random weights and prompts for
   a preset without a fixture.
5. Batched rows (protocol v2 adapters only, the built-in engine included):
   every trace of a model fixture as one request of one batch through the
   adapter's own cache and compaction, the kernel cases batched, each
   request's share compared as above, the time per stage of the batched run
   reported (rows/batched.py, rows/batched_model.py).

Every adapter call goes through `door.checked.CheckedAdapter`: an exception (sys.exit
and any BaseException but Ctrl-C included) or an output of the wrong arity,
dtype, shape or finiteness is a FAIL row naming the method and the output. A v2 adapter's calls are also held to protocol v2's
declarations (`door.checked.CheckedV2`: torch tensors on its device, ragged offsets)
and reach the per-request checks through `protocol_v2.PerRequest`. A capability the adapter does not implement turns its
checks into "skipped (not implemented by adapter)"; a required capability
(door.capabilities.resolve_capabilities: by default what the adapter declares, else what
it implements) that is skipped or that no fixture exercised is a FAIL. The
report fails when any row is FAIL or when no row ran.

`validate(..., dtype="bfloat16")` tells the adapter its dtype (`set_dtype`) and
checks the model fixtures' bf16 cases in the bf16 regime: tolerances and near-tie
thresholds from the measured bf16 error model, and routing flips told apart from
routing bugs (judging/regime.py, docs/precision.md). Every row names its regime.

Packages, one job each, imports running one way (reports <- judging <- door <- rows <- run;
docs/architecture.md draws them):

- `reports`: the row (`Check`), the report and its JSON, JUnit XML and HTML forms;
- `judging`: one comparison -> one row (compare), how a dtype judges rows and the routing
  watch (regime), acceptance per depth, declared deviations, a served request's known
  prefixes, and the statistical test of a sampler's law (distribution, needs scipy);
- `door`: how an adapter's code is entered: the protocols (protocol, protocol_v2) and their
  capabilities, loading `--impl module:factory` (load), the guard around every entry, the
  checking proxies (checked), and the supervisor that runs a validation in a watched child;
- `rows`: the sections above, per fixture and stage (model, engine, kernel, corpus, paged,
  batched, batched_model, invariant, served, speculation);
- `run`: all of them in order, then the requirements, or one case at a time (runner: `plan`,
  `Validation`); the run in the supervised child (isolated); a serving engine over HTTP
  (server: `kdtree validate --server`, docs/serving.md).

`fixtures` (finding the fixtures, their weights) sits beside them, below the rows.
`engine.validate.protocol` and `engine.validate.protocol_v2` are the paths adapters import the
protocols by. This package's names below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# The public names by the module that defines it. A name loads its module on first use, so that
# importing one part (the supervisor's parent process: door/supervise.py) imports neither torch
# nor the engine.
_EXPORTS: dict[str, tuple[str, ...]] = {
    ".door.protocol": ("CAPABILITIES", "METHODS", "EngineAdapter"),
    ".door.protocol_v2": ("CAPABILITIES_V2", "METHODS_V2", "PerRequest"),
    ".door.capabilities": ("capabilities", "resolve_capabilities"),
    ".door.load": ("load_impl",),
    ".door.checked": ("AdapterFault", "CheckedAdapter", "CheckedV2"),
    ".fixtures": ("GOLDEN_DIR", "REPO_ROOT", "find_fixtures", "model_fixture_config"),
    ".judging.compare": ("SKIPPED_DETAIL", "classify_divergence", "compare_close", "compare_exact", "compare_tokens",
                         "compare_tree", "merge", "row", "skipped", "unpack_bits"),
    ".judging.deviations": ("Deviation", "declared_deviations"),
    ".reports.report": ("Check", "Report", "Status", "ValidateError", "write_json"),
    ".rows.engine": ("replayed_round",),
    ".rows.invariant": ("INVARIANT_DDTREE", "INVARIANT_TOKENS", "MARGIN_REL", "invariant_checks",
                        "preset_invariant_checks", "random_weights"),
    ".run.runner": ("Case", "Validation", "plan", "validate"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
