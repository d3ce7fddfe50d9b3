"""`kdtree validate`: check an implementation against the golden fixtures.

Sections of the report, each a list of `Check` rows:

1. Model fixtures (`<preset>.kdtr`), through the adapter protocol
   (protocol.py): prefill logits and verify logits within the fixture's
   tolerance (the worst error and its tolerance reported); AR tokens, tree
   build, target choices, accept and committed tokens exact; for sampled
   traces the adapter's sample_accept with the fixture's uniforms, and the
   fixture's adversarial sampling cases, exact. A token that differs is
   reported with the fixture's margin at that decision: below the fixture's
   margin_threshold it is a near-tie (reported, not a failure), above it a
   FAIL. Traces are replayed teacher-forced: each round takes the fixture's
   start, root, draft and tree, so one wrong round cannot hide the rest.
2. Engine decode (the built-in engine only, engine_rows.py): `engine.decode`
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
   only: paged_checks.py): verify attention and compaction through a block table.
4. The invariant (the built-in engine only): DDTree greedy == AR greedy for
   every preset, with the oracle, random and layerskip drafters: on each model
   fixture's weights and prompts, and on seeded random weights and prompts for
   a preset without a fixture.
5. Batched rows (protocol v2 adapters only, the built-in engine included):
   every trace of a model fixture as one request of one batch through the
   adapter's own cache and compaction, the kernel cases batched, each
   request's share compared as above, the time per stage of the batched run
   reported (batched.py, batched_model.py).

Every adapter call goes through `checked.CheckedAdapter`: an exception (sys.exit
and any BaseException but Ctrl-C included) or an output of the wrong arity,
dtype, shape or finiteness is a FAIL row naming the method and the output. A v2 adapter's calls are also held to protocol v2's
declarations (`checked.CheckedV2`: torch tensors on its device, ragged offsets)
and reach the per-request checks through `protocol_v2.PerRequest`. A capability the adapter does not implement turns its
checks into "skipped (not implemented by adapter)"; a required capability
(protocol.resolve_capabilities: by default what the adapter declares, else what
it implements) that is skipped or that no fixture exercised is a FAIL. The
report fails when any row is FAIL or when no row ran.

`validate(..., dtype="bfloat16")` tells the adapter its dtype (`set_dtype`) and
checks the model fixtures' bf16 cases in the bf16 regime: tolerances and near-tie
thresholds from the measured bf16 error model, and routing flips told apart from
routing bugs (regime.py, docs/precision.md). Every row names its regime.

Modules, one job each: `protocol` (what an adapter implements, each method's
outputs, capability declarations), `protocol_v2` (the batched protocol, its
declarations, the per-request view of a v2 adapter), `guard` (the door: every
entry into the adapter's code, whatever ends it named), `checked` (the checking
proxies), `report` (rows, the report, JSON), `compare` (one comparison -> one
row), `regime` (how a dtype judges rows, the routing watch), `fixtures`
(finding them), `model_checks`, `engine_rows`, `kernel_checks` and `invariant`
(the sections above), `deviations` (what an adapter declares about where it differs from the
reference, noted on the rows it affects), `batched` and `batched_model` (the
batched rows), `paged_checks` (the paged-KV rows), `runner` (all of them in order, then the requirements; or one case,
one row, at a time: `plan`, `Validation`), `isolated` (a run in the child process
that `kdtree validate` watches, engine/supervise.py), and the report's other
forms, `junit` (JUnit XML) and `html` (a self-contained page).
`distribution` (the statistical test of a sampler's law, for implementations
that draw their own uniforms; it needs scipy) is imported on its own, and so is
`server` (`kdtree validate --server`: a running serving engine over HTTP, through
engine/serving's clients, judged by `served` along the fixture's known prefixes,
`prefixes`; docs/serving.md).
"""

from .checked import AdapterFault, CheckedAdapter, CheckedV2
from .compare import (SKIPPED_DETAIL, classify_divergence, compare_close, compare_exact, compare_tokens,
                      compare_tree, merge, row, skipped, unpack_bits)
from .deviations import Deviation, declared_deviations
from .fixtures import GOLDEN_DIR, REPO_ROOT, find_fixtures, model_fixture_config
from .invariant import INVARIANT_DDTREE, INVARIANT_TOKENS, MARGIN_REL, invariant_checks, \
    preset_invariant_checks, random_weights
from .engine_rows import replayed_round
from .protocol import CAPABILITIES, METHODS, EngineAdapter, capabilities, load_impl, resolve_capabilities
from .protocol_v2 import CAPABILITIES_V2, METHODS_V2, PerRequest
from .report import Check, Report, Status, ValidateError, write_json
from .runner import Case, Validation, plan, validate

__all__ = [
    "AdapterFault", "CAPABILITIES", "CAPABILITIES_V2", "Case", "Check", "CheckedAdapter", "CheckedV2", "METHODS_V2",
    "PerRequest", "Deviation", "EngineAdapter", "GOLDEN_DIR",
    "INVARIANT_DDTREE", "INVARIANT_TOKENS", "METHODS", "resolve_capabilities", "row",
    "MARGIN_REL", "REPO_ROOT", "Report", "SKIPPED_DETAIL", "Status", "ValidateError", "capabilities",
    "classify_divergence", "compare_close", "compare_exact", "compare_tokens", "compare_tree",
    "declared_deviations", "find_fixtures", "invariant_checks", "load_impl", "merge", "model_fixture_config",
    "plan", "preset_invariant_checks", "random_weights", "replayed_round", "skipped", "unpack_bits",
    "Validation", "validate", "write_json",
]
