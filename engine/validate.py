"""`kdtree validate`: check an implementation against the golden fixtures.

Sections of the report, each a list of `Check` rows:

1. Model fixtures (`<preset>.kdtr`), through the adapter protocol
   (engine/adapter.py): prefill logits and verify logits within the fixture's
   tolerance (the worst error and its tolerance reported); AR tokens, tree
   build, target choices, accept and committed tokens exact. A token that
   differs is reported with the fixture's margin at that decision: below the
   fixture's margin_threshold it is a near-tie (reported, not a failure),
   above it a FAIL. Traces are replayed teacher-forced: each round takes the
   fixture's start, root, draft and tree, so one wrong round cannot hide the
   rest.
2. Engine decode (the built-in engine only): `engine.decode` batched over the
   fixture's prompts (AR) and traces (DDTree with the replay drafter: every
   round's tree, choices and acceptance exact).
3. Kernel cases (`kernels/*.kdtr`): top-k from draft logits, tree build
   (float64 scores too) and compile (positions, visibility bits, EAGLE links)
   bit-exact from the given top-k, accept and compaction exact, verify
   attention within tolerance.
4. The invariant (the built-in engine only): DDTree greedy == AR greedy for
   every preset, with the oracle, random and layerskip drafters: on each model
   fixture's weights and prompts, and on seeded random weights and prompts for
   a preset without a fixture.

A missing adapter method turns its checks into "skipped (not implemented by
adapter)". The report fails when any check is FAIL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

import kdtr_format
from kdtr_format import PRESETS, DDTreeConfig, KdtrError, ModelConfig

from .adapter import TorchAdapter, capabilities
from .decode import ar_decode, ddtree_decode
from .drafters import LayerSkipDrafter, OracleDrafter, RandomDrafter, ReplayDrafter
from .weights import weight_shapes

REPO_ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"
SKIPPED_DETAIL = "skipped (not implemented by adapter)"
DEFAULT_ATTENTION_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}

# The invariant's DDTree setting and drafters (small: it runs on every fixture's weights).
INVARIANT_DDTREE = DDTreeConfig(block_size=5, budget=12)
INVARIANT_TOKENS = 16
MARGIN_REL = 1e-3              # near-tie threshold relative to the logits' spread, as refgen's fixtures


class ValidateError(Exception):
    """Bad input to the runner (missing fixtures, a fixture that contradicts its preset)."""


class Status(str, Enum):
    EXACT = "exact"
    WITHIN = "within tolerance"
    NEAR_TIE = "near-tie"
    SKIPPED = "skipped"
    FAIL = "FAIL"


_SEVERITY = {Status.SKIPPED: 0, Status.EXACT: 1, Status.WITHIN: 2, Status.NEAR_TIE: 3, Status.FAIL: 4}


@dataclass
class Check:
    """One row of the report. error / tolerance: the worst element's |actual - expected| and
    its tolerance (floats); margin: the reference's top1 - top2 logit gap at a token divergence."""

    section: str
    name: str
    status: Status
    error: float | None = None
    tolerance: float | None = None
    margin: float | None = None
    detail: str = ""

    @property
    def ratio(self) -> float:
        if self.error is None or not self.tolerance:
            return 0.0 if not self.error else float("inf")
        return self.error / self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status.value}


@dataclass
class Report:
    implementation: str
    device: str
    fixtures: str
    backends: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(c.status is Status.FAIL for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s.value: sum(c.status is s for c in self.checks) for s in Status}

    def summary(self) -> str:
        counts = self.counts()
        verdict = "FAILED" if self.failed else "PASSED"
        parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return f"{verdict}: {len(self.checks)} checks ({parts})"

    def to_dict(self) -> dict[str, Any]:
        return {"implementation": self.implementation, "device": self.device, "fixtures": self.fixtures,
                "backends": self.backends, "passed": not self.failed, "counts": self.counts(),
                "summary": self.summary(), "checks": [c.to_dict() for c in self.checks]}


# ---- comparisons: each returns one Check ----

def classify_divergence(margin: float, threshold: float) -> Status:
    """A token that differs from the reference at a decision with this margin:
    a near-tie below the threshold (no float32 implementation can be blamed), else a FAIL."""
    return Status.NEAR_TIE if margin < threshold else Status.FAIL


def compare_exact(section: str, name: str, actual: Any, expected: Any, where: str = "") -> Check:
    """Integer (or bit-exact float) outputs: shape and every value equal."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    at = f" ({where})" if where else ""
    if actual.shape != expected.shape:
        return Check(section, name, Status.FAIL,
                     detail=f"shape {list(actual.shape)} != expected {list(expected.shape)}{at}")
    differ = np.flatnonzero(actual.reshape(-1) != expected.reshape(-1))
    if differ.size:
        i = int(differ[0])
        index = np.unravel_index(i, expected.shape) if expected.ndim else ()
        return Check(section, name, Status.FAIL,
                     detail=f"{differ.size} differ; first at {list(map(int, index))}: got "
                            f"{actual.reshape(-1)[i]}, expected {expected.reshape(-1)[i]}{at}")
    return Check(section, name, Status.EXACT)


def compare_close(section: str, name: str, actual: Any, expected: Any, rtol: float,
                  atol: float | np.ndarray, where: str = "") -> Check:
    """|actual - expected| <= atol + rtol |expected| everywhere; reports the worst element."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    at = f" ({where})" if where else ""
    if actual.shape != expected.shape:
        return Check(section, name, Status.FAIL,
                     detail=f"shape {list(actual.shape)} != expected {list(expected.shape)}{at}")
    if expected.size == 0:
        return Check(section, name, Status.EXACT)
    if not np.isfinite(actual).all():
        return Check(section, name, Status.FAIL, detail=f"non-finite values in the output{at}")
    error = np.abs(actual - expected)
    tolerance = np.broadcast_to(atol + rtol * np.abs(expected), error.shape)
    worst = int(np.argmax(error / np.maximum(tolerance, np.finfo(np.float64).tiny)))
    err, tol = float(error.reshape(-1)[worst]), float(tolerance.reshape(-1)[worst])
    if err > tol:
        index = list(map(int, np.unravel_index(worst, expected.shape)))
        return Check(section, name, Status.FAIL, err, tol, detail=f"worst at {index}{at}")
    status = Status.EXACT if not error.any() else Status.WITHIN
    return Check(section, name, status, float(error.max()) if status is Status.EXACT else err, tol)


def compare_tokens(section: str, name: str, actual: Any, expected: Any, margins: Any,
                   threshold: float, where: str = "") -> Check:
    """Token decisions: equal, or the first divergence classified by the reference's margin there."""
    actual, expected = np.asarray(actual).reshape(-1), np.asarray(expected).reshape(-1)
    at = f" ({where})" if where else ""
    n = min(len(actual), len(expected))
    differ = np.flatnonzero(actual[:n] != expected[:n])
    if differ.size == 0:
        if len(actual) != len(expected):
            return Check(section, name, Status.FAIL,
                         detail=f"{len(actual)} tokens, expected {len(expected)}{at}")
        return Check(section, name, Status.EXACT)
    margins = np.asarray(margins, dtype=np.float64).reshape(-1)
    statuses = [classify_divergence(float(margins[i]), threshold) for i in differ]
    worst = max(range(len(differ)), key=lambda k: _SEVERITY[statuses[k]])
    i = int(differ[worst])
    return Check(section, name, statuses[worst], margin=float(margins[i]), tolerance=threshold,
                 detail=f"first divergence at {int(differ[0])}; at {i}: got {actual[i]}, expected "
                        f"{expected[i]}, margin {margins[i]:.3g} vs threshold {threshold:.3g}{at}")


def merge(section: str, name: str, checks: Iterable[Check]) -> Check:
    """One row for many comparisons of a kind: the worst status, the worst error ratio,
    and the detail of the first failure (else of the worst)."""
    checks = list(checks)
    if not checks:
        return Check(section, name, Status.SKIPPED, detail="nothing to compare")
    status = max((c.status for c in checks), key=_SEVERITY.get)
    worst = max(checks, key=lambda c: c.ratio)
    telling = next((c for c in checks if c.status is status), worst)
    margin = min((c.margin for c in checks if c.margin is not None), default=None)
    tolerance = worst.tolerance if worst.error is not None else telling.tolerance
    return Check(section, name, status, worst.error, tolerance, margin,
                 telling.detail if telling.status is not Status.EXACT else "")


def skipped(section: str, name: str) -> Check:
    return Check(section, name, Status.SKIPPED, detail=SKIPPED_DETAIL)


# ---- fixtures ----

def find_fixtures(fixtures: str | os.PathLike | None, generate: bool = True) -> Path:
    """The fixture directory: `fixtures` if given (it must hold .kdtr files), else the
    committed tests/golden, else a cache directory filled by `python -m refgen generate --all`."""
    if fixtures is not None:
        path = Path(fixtures)
        if not path.is_dir():
            raise ValidateError(f"fixture directory {path} does not exist")
        if not _kdtr_files(path):
            raise ValidateError(f"no .kdtr fixtures in {path}")
        return path
    if _kdtr_files(GOLDEN_DIR):
        return GOLDEN_DIR
    cache = Path(os.environ.get("KDTREE_CACHE_DIR", Path.home() / ".cache" / "kdtree")) / "fixtures"
    if _kdtr_files(cache):
        return cache
    if not generate:
        raise ValidateError(f"no fixtures in {GOLDEN_DIR} or {cache}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fixtures.", dir=cache.parent))   # all or nothing
    staging.chmod(0o755)
    run = subprocess.run([sys.executable, "-m", "refgen", "generate", "--all", "--out", str(staging)],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    if run.returncode != 0 or not _kdtr_files(staging):
        shutil.rmtree(staging, ignore_errors=True)
        last = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ValidateError(f"no fixtures found and `refgen generate` failed: {last[0]}")
    if cache.exists():
        cache.rmdir()
    os.replace(staging, cache)
    return cache


def _kdtr_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.kdtr")) + sorted(path.glob("kernels/*.kdtr")) if path.is_dir() else []


def model_fixture_config(reader, path: Path) -> ModelConfig:
    """The fixture's config; a fixture naming a preset must hold exactly that preset's config."""
    metadata = reader.metadata
    try:
        cfg = ModelConfig.from_dict(metadata["config"])
    except (KeyError, KdtrError) as exc:
        raise ValidateError(f"{path.name}: no valid model config in its metadata ({exc})") from None
    preset = metadata.get("preset")
    if preset in PRESETS and PRESETS[preset] != cfg:
        raise ValidateError(f"{path.name}: its config differs from preset {preset!r} (a fixture of "
                            f"another config?)")
    return cfg


def unpack_bits(words: np.ndarray, width: int) -> np.ndarray:
    """visibility_bits [rows, W] (uint32 / int32 words, bit b of word w = column 32w + b) -> bool [rows, width]."""
    as_bytes = np.ascontiguousarray(words).astype("<u4").view(np.uint8).reshape(len(words), -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width].astype(bool)


def _int(x: Any) -> int:
    return int(np.asarray(x).reshape(()))


# ---- the runner ----

def validate(adapter: Any | None = None, fixtures: str | os.PathLike | None = None, device: str = "cpu",
             log: Callable[[str], None] = lambda line: None) -> Report:
    """Run every check (module docstring) and return the report. adapter None = the built-in engine."""
    builtin = adapter is None
    if builtin:
        adapter = TorchAdapter(device)
    directory = find_fixtures(fixtures)
    report = Report(implementation=getattr(adapter, "name", type(adapter).__name__), device=device,
                    fixtures=str(directory), backends=dict(getattr(adapter, "backends", {})))
    caps = capabilities(adapter)
    for path in _kdtr_files(directory):
        log(f"checking {path.relative_to(directory)}")
        try:
            with kdtr_format.open(path) as reader:
                kind = reader.metadata.get("kind")
                if kind == "model":
                    report.checks += _model_fixture(adapter, caps, reader, path, builtin)
                elif kind in _KERNEL_CASES:
                    report.checks += _KERNEL_CASES[kind](adapter, caps, reader,
                                                         str(path.relative_to(directory)))
                else:
                    report.checks.append(Check(path.name, "fixture", Status.FAIL,
                                               detail=f"unknown fixture kind {kind!r}"))
        except KdtrError as exc:
            raise ValidateError(f"{path}: {exc}") from None
        except ValidateError:
            raise
        except Exception as exc:        # an adapter that crashes fails this fixture, not the run
            report.checks.append(Check(path.name, "run", Status.FAIL, detail=f"{type(exc).__name__}: {exc}"))
    if builtin:
        for preset in sorted(set(PRESETS) - {p.stem for p in _kdtr_files(directory)}):
            log(f"invariant on preset {preset} (no fixture: random weights)")
            report.checks += preset_invariant_checks(adapter, preset)
    return report


def _model_fixture(adapter: Any, caps: set[str], reader, path: Path, builtin: bool) -> list[Check]:
    cfg = model_fixture_config(reader, path)
    metadata = reader.metadata
    section = path.name
    tol = metadata["tolerances"]
    threshold = float(metadata["margin_threshold"])
    fixture = _Fixture(reader, cfg, tol, threshold)
    checks: list[Check] = []
    if "model" in caps:
        adapter.load_weights(cfg, {name[len("weights/"):]: np.array(reader[name])
                                   for name in reader.names("weights/")})
        prefill, ar = [], []
        for prompt in metadata["prompts"]:
            p, a = fixture.prompt_checks(adapter, section, prompt["name"])
            prefill.append(p)
            ar.append(a)
        checks += [merge(section, "prefill logits", prefill), merge(section, "AR tokens", ar)]
    else:
        checks += [skipped(section, "prefill logits"), skipped(section, "AR tokens")]
    checks += fixture.trace_checks(adapter, caps, section)
    if builtin:
        checks += fixture.engine_decode_checks(adapter, section)
        checks += invariant_checks(adapter, [fixture[f"prompts/{p['name']}/tokens"] for p in metadata["prompts"]],
                                   threshold, section)
    return checks


class _Fixture:
    """A model fixture's tensors, read lazily, and the checks over them."""

    def __init__(self, reader, cfg: ModelConfig, tolerances: Mapping[str, Any], threshold: float) -> None:
        self.reader, self.cfg, self.tol, self.threshold = reader, cfg, tolerances, threshold
        self.traces = reader.metadata["traces"]

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.reader[name])

    def close(self, section: str, name: str, actual, expected, kind: str, where: str) -> Check:
        rule = self.tol[kind]
        return compare_close(section, name, actual, expected, rule["rtol"], rule["atol"], where)

    def max_len(self) -> int:
        longest = max(p["length"] for p in self.reader.metadata["prompts"])
        most = max((t["max_new_tokens"] for t in self.traces), default=0)
        ar_tokens = max(len(self[f"prompts/{p['name']}/ar/tokens"]) for p in self.reader.metadata["prompts"])
        budget = max((t["ddtree"]["budget"] for t in self.traces), default=0)
        return longest + max(most, ar_tokens) + budget + 2

    def prompt_checks(self, adapter, section: str, name: str) -> tuple[Check, Check]:
        """Prefill logits and the adapter's own AR greedy loop (stops at the first divergence)."""
        prompt = self[f"prompts/{name}/tokens"]
        expected = self[f"prompts/{name}/ar/tokens"]
        margins = self[f"prompts/{name}/ar/margins"]
        m = len(prompt)
        adapter.reset(self.max_len())
        logits = adapter.forward(prompt, np.arange(m), np.tri(m, dtype=bool), 0)
        prefill = self.close(section, "prefill logits", logits, self[f"prompts/{name}/prefill_logits"],
                             "logits", f"prompt {name}")
        tokens = [int(np.argmax(logits[-1]))]
        while len(tokens) < len(expected) and tokens[-1] == expected[len(tokens) - 1]:
            start = m + len(tokens) - 1
            step = adapter.forward(np.array([tokens[-1]]), np.array([start]),
                                   np.ones((1, start + 1), dtype=bool), start)
            tokens.append(int(np.argmax(step[-1])))
        ar = compare_tokens(section, "AR tokens", tokens, expected[:len(tokens)], margins, self.threshold,
                            f"prompt {name}")
        if ar.status is Status.EXACT and len(tokens) != len(expected):
            ar = Check(section, "AR tokens", Status.FAIL, detail=f"prompt {name}: stopped early")
        return prefill, ar

    def trace_checks(self, adapter, caps: set[str], section: str) -> list[Check]:
        """Every trace replayed teacher-forced through the adapter (module docstring)."""
        found: dict[str, list[Check]] = {k: [] for k in
                                         ("top-k log-probs", "tree build", "tree compile", "verify logits",
                                          "target choices", "accept", "DDTree tokens")}
        for trace in self.traces:
            if trace["ddtree"].get("temperature", 0.0) == 0.0:
                self._trace(adapter, caps, section, trace, found)
        needs = {"top-k log-probs": {"topk"}, "tree build": {"tree"}, "tree compile": {"compile"},
                 "verify logits": {"model"},
                 "target choices": {"model"}, "accept": {"accept"}, "DDTree tokens": {"model", "accept"}}
        return [merge(section, name, rows) if needs[name] <= caps else skipped(section, name)
                for name, rows in found.items()]

    def _trace(self, adapter, caps: set[str], section: str, trace: Mapping[str, Any],
               found: dict[str, list[Check]]) -> None:
        name = trace["name"]
        prefix = f"traces/{name}"
        prompt = self[f"prompts/{trace['prompt']}/tokens"]
        budget = int(trace["ddtree"]["budget"])
        committed: list[int] = []          # the adapter's own: its prefill's argmax, then its rounds
        if "model" in caps:
            adapter.reset(self.max_len())
            m = len(prompt)
            committed.append(int(np.argmax(adapter.forward(prompt, np.arange(m), np.tri(m, dtype=bool), 0)[-1])))
        for r in range(int(trace["rounds"])):
            rp = f"{prefix}/rounds/{r}"
            where = f"trace {name} round {r}"
            start, root = _int(self[f"{rp}/start"]), _int(self[f"{rp}/root"])
            parents, tokens, depths = self[f"{rp}/parents"], self[f"{rp}/tokens"], self[f"{rp}/depths"]
            topk_lp, topk_id = self[f"{rp}/topk_lp"], self[f"{rp}/topk_id"]
            choices_expected, margins = self[f"{rp}/choices"], self[f"{rp}/margins"]
            accepted_expected = self[f"{rp}/accepted"]
            if "topk" in caps and topk_lp.shape[0] > 0:
                lp, ids = adapter.topk_logprobs(self[f"{rp}/draft_logits"], topk_id.shape[1])
                found["top-k log-probs"] += [compare_exact(section, "top-k ids", ids, topk_id, where),
                                             self.close(section, "top-k lp", lp, topk_lp, "logprobs", where)]
            if "tree" in caps:
                found["tree build"] += compare_tree(section, adapter.build_tree(topk_lp, topk_id, budget, root),
                                                    (parents, tokens, depths, self[f"{rp}/scores"]), where)
            if "compile" in caps:
                positions, bits, _, _ = adapter.compile_tree(parents, depths, start)
                found["tree compile"] += [
                    compare_exact(section, "positions", positions, self[f"{rp}/positions"], where),
                    compare_exact(section, "visibility bits", _words(bits), _words(self[f"{rp}/visibility_bits"]),
                                  where)]
            choices = choices_expected
            if "model" in caps:
                n = len(tokens)
                visibility = np.concatenate([np.ones((n, start), dtype=bool),
                                             unpack_bits(self[f"{rp}/visibility_bits"], n)], axis=1)
                logits = adapter.forward(tokens, self[f"{rp}/positions"], visibility, start)
                found["verify logits"].append(self.close(section, "verify logits", logits,
                                                         self[f"{rp}/verify_logits"], "logits", where))
                choices = np.argmax(logits, axis=-1)
                found["target choices"].append(compare_tokens(section, "target choices", choices,
                                                              choices_expected, margins, self.threshold, where))
                a = len(accepted_expected)
                restated = adapter.forward(tokens[accepted_expected], start + np.arange(a),
                                           np.concatenate([np.ones((a, start), dtype=bool),
                                                           np.tri(a, dtype=bool)], axis=1), start)
                found["verify logits"].append(self.close(
                    section, "verify logits", restated, self[f"{rp}/verify_logits"][accepted_expected],
                    "logits", f"{where}, accepted path restated causally"))
            if "accept" in caps:
                accepted, next_root = adapter.accept(parents, tokens, choices_expected)
                found["accept"] += [compare_exact(section, "accepted", accepted, accepted_expected, where),
                                    compare_exact(section, "next root", next_root,
                                                  _int(self[f"{rp}/next_root"]), where)]
                if "model" in caps:
                    path, bonus = adapter.accept(parents, tokens, choices)
                    committed += [int(t) for t in tokens[np.asarray(path)[1:]]] + [int(bonus)]
        if {"model", "accept"} <= caps:
            expected = self[f"{prefix}/tokens"]
            found["DDTree tokens"].append(compare_tokens(section, "DDTree tokens",
                                                         committed[:len(expected)], expected,
                                                         self[f"prompts/{trace['prompt']}/ar/margins"],
                                                         self.threshold, f"trace {name}"))

    def engine_decode_checks(self, adapter: TorchAdapter, section: str) -> list[Check]:
        """The built-in engine's own batched decode loops against the fixture."""
        model, stages = adapter.model, adapter.stages
        prompts = [p["name"] for p in self.reader.metadata["prompts"]]
        expected = [self[f"prompts/{p}/ar/tokens"] for p in prompts]
        ar = ar_decode(model, [self[f"prompts/{p}/tokens"] for p in prompts], [len(e) for e in expected],
                       stages=stages)
        checks = [merge(section, "engine AR decode (batched)",
                        [compare_tokens(section, "engine AR decode", got.tokens, want,
                                        self[f"prompts/{p}/ar/margins"], self.threshold, f"prompt {p}")
                         for p, got, want in zip(prompts, ar.requests, expected)])]
        rows = []
        greedy = [t for t in self.traces if t["ddtree"].get("temperature", 0.0) == 0.0]
        for block_size in sorted({t["ddtree"]["block_size"] for t in greedy}):
            group = [t for t in greedy if t["ddtree"]["block_size"] == block_size]
            rows += self._replay(model, stages, section, group)
        checks.append(merge(section, "engine DDTree replay (batched)", rows))
        return checks

    def _replay(self, model, stages, section: str, traces: list[Mapping[str, Any]]) -> list[Check]:
        """Traces of one block size in one batch, each with its own budget and length."""
        recorded = [{_int(self[f"traces/{t['name']}/rounds/{r}/start"]):
                     self[f"traces/{t['name']}/rounds/{r}/draft_logits"] for r in range(t["rounds"])}
                    for t in traces]
        ddtree = DDTreeConfig.from_dict(traces[0]["ddtree"])
        result = ddtree_decode(model, ReplayDrafter(recorded, self.cfg.vocab_size, model.device),
                               [self[f"prompts/{t['prompt']}/tokens"] for t in traces], ddtree,
                               [int(t["max_new_tokens"]) for t in traces],
                               budgets=[int(t["ddtree"]["budget"]) for t in traces], stages=stages, record=True)
        rows = []
        for t, request in zip(traces, result.requests):
            name = t["name"]
            expected = self[f"traces/{name}/tokens"]
            rows.append(compare_tokens(section, "tokens", request.tokens[:len(expected)], expected,
                                       self[f"prompts/{t['prompt']}/ar/margins"], self.threshold,
                                       f"trace {name}"))
            rows.append(compare_exact(section, "acceptance lengths", request.acceptance_lengths,
                                      self[f"traces/{name}/acceptance_lengths"], f"trace {name}"))
            for r, got in enumerate(request.rounds[:t["rounds"]]):
                rp, where = f"traces/{name}/rounds/{r}", f"trace {name} round {r}"
                # The engine computed its own top-k from the draft logits here, and the contract lets
                # top-k lp differ by a float32 ulp between implementations. Where they do and the tree
                # then differs, that is a score near-tie, not a bug: the round's rows are near-ties (the
                # bit-exact tree build from the fixture's top-k is checked on its own, and the committed
                # tokens above stay exact). Scores are compared with the log-prob tolerance.
                round_rows = [compare_exact(section, what, getattr(got, what).numpy(), self[f"{rp}/{what}"],
                                            where) for what in ("parents", "tokens", "depths", "accepted")]
                round_rows += [
                    self.close(section, "scores", got.scores.numpy(), self[f"{rp}/scores"], "logprobs", where),
                    compare_tokens(section, "choices", got.choices.numpy(), self[f"{rp}/choices"],
                                   self[f"{rp}/margins"], self.threshold, where),
                    compare_exact(section, "next root", got.next_root, _int(self[f"{rp}/next_root"]), where)]
                rows += replayed_round(round_rows, tree_rows=3,
                                       same_topk=np.array_equal(got.topk_lp.numpy(), self[f"{rp}/topk_lp"]))
        return rows


def replayed_round(rows: list[Check], tree_rows: int, same_topk: bool) -> list[Check]:
    """A replayed round's checks, the first `tree_rows` of them on the tree's shape. When the
    implementation's own top-k log-probs differ from the fixture's (by the float32 ulp the contract
    allows) and the tree differs, every failing row of the round is a near-tie, not a bug."""
    tree_differs = any(row.status is Status.FAIL for row in rows[:tree_rows])
    if same_topk or not tree_differs:
        return rows
    return [dataclasses.replace(row, status=Status.NEAR_TIE,
                                detail=f"{row.detail}; top-k lp differ from the fixture's (contract: a score near-tie)")
            if row.status is Status.FAIL else row for row in rows]


def invariant_checks(adapter: TorchAdapter, prompts: list[np.ndarray], threshold: float,
                     section: str) -> list[Check]:
    """DDTree greedy == AR greedy on the adapter's loaded weights and these prompts, per drafter.
    A divergence is judged by AR's margin there against `threshold`."""
    model, stages, cfg = adapter.model, adapter.stages, adapter.model.cfg
    ar = ar_decode(model, prompts, INVARIANT_TOKENS, stages=stages)
    truth = [np.concatenate([p, r.tokens]) for p, r in zip(prompts, ar.requests)]
    drafters = {
        "oracle": OracleDrafter(truth, cfg.vocab_size, accuracy=0.7, seed=5, device=model.device),
        "random": RandomDrafter(cfg.vocab_size, seed=6, device=model.device),
        "layerskip": LayerSkipDrafter(cfg, adapter.weights, max(1, cfg.num_hidden_layers // 2),
                                      device=model.device, dtype=model.dtype),
    }
    checks = []
    for name, drafter in drafters.items():
        result = ddtree_decode(model, drafter, prompts, INVARIANT_DDTREE, INVARIANT_TOKENS, stages=stages)
        rows = [compare_tokens(section, name, got.tokens, want.tokens, want.margins, threshold, f"prompt {i}")
                for i, (got, want) in enumerate(zip(result.requests, ar.requests))]
        check = merge(section, f"invariant DDTree == AR ({name})", rows)
        forwards = (f"tau {result.metrics.mean_acceptance:.2f}, target forwards "
                    f"{result.metrics.target_forwards} vs AR {ar.metrics.target_forwards}")
        check.detail = f"{check.detail}; {forwards}" if check.detail else forwards
        checks.append(check)
    return checks


def random_weights(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights made with torch: linear maps scaled by 1/sqrt(fan-in), norm
    weights 1, a small random routing bias (for presets without a fixture, and benchmarks)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("e_score_correction_bias"):
            value = torch.randn(shape, device=device, generator=generator) * 1e-2
        elif len(shape) == 1:
            value = torch.ones(shape, device=device)
        else:
            value = torch.randn(shape, device=device, generator=generator) * shape[-1] ** -0.5
        weights[name] = value.to(dtype)
    return weights


def preset_invariant_checks(adapter: TorchAdapter, preset: str) -> list[Check]:
    """The invariant for a preset without a model fixture: random weights and prompts;
    near-tie threshold MARGIN_REL x the logits' standard deviation (as refgen's fixtures)."""
    cfg = PRESETS[preset]
    adapter.load_weights(cfg, random_weights(cfg, seed=0))
    generator = np.random.default_rng(0)
    prompts = [generator.integers(0, cfg.vocab_size, size=n) for n in (4, 9, 17)]
    probe = adapter.model.forward(*_causal_batch(prompts[-1], adapter.model.device), adapter.model.new_cache(1, 17))
    return invariant_checks(adapter, prompts, MARGIN_REL * float(probe.double().std()), f"{preset} (random weights)")


def _causal_batch(prompt: np.ndarray, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One prompt as a causal prefill batch: tokens, positions, visibility, n_new, starts."""
    m = len(prompt)
    return (torch.tensor(prompt, device=device)[None], torch.arange(m, device=device)[None],
            torch.ones(m, m, dtype=torch.bool, device=device).tril()[None], torch.tensor([m], device=device),
            torch.zeros(1, dtype=torch.int64, device=device))


# ---- kernel cases ----

def _cases(reader) -> list[Mapping[str, Any]]:
    return reader.metadata.get("cases", [])


def _tree_build_cases(adapter, caps: set[str], reader, section: str) -> list[Check]:
    topk_rows, tree_rows, compile_rows = [], [], []
    for case in _cases(reader):
        p = f"cases/{case['name']}/"
        where = f"case {case['name']}"
        topk_lp, topk_id = np.asarray(reader[p + "topk_lp"]), np.asarray(reader[p + "topk_id"])
        if "topk" in caps and p + "draft_logits" in reader and topk_lp.shape[0] > 0:
            lp, ids = adapter.topk_logprobs(np.asarray(reader[p + "draft_logits"]), topk_id.shape[1])
            topk_rows += [compare_exact(section, "top-k ids", ids, topk_id, where),
                          compare_close(section, "top-k lp", lp, topk_lp, 0.0,
                                        np.spacing(np.abs(topk_lp).astype(np.float32)), where)]
        parents, depths = np.asarray(reader[p + "parents"]), np.asarray(reader[p + "depths"])
        if "tree" in caps:
            expected = (parents, np.asarray(reader[p + "tokens"]), depths, np.asarray(reader[p + "scores"]))
            tree_rows += compare_tree(section, adapter.build_tree(topk_lp, topk_id, int(case["budget"]), -1),
                                      expected, where)
        if "compile" in caps:
            compiled = adapter.compile_tree(parents, depths, int(case["start"]))
            compile_rows += [compare_exact(section, what, _words(got) if what == "visibility_bits" else got,
                                           _words(reader[p + what]) if what == "visibility_bits" else reader[p + what],
                                           where)
                             for what, got in zip(("positions", "visibility_bits", "first_child", "next_sibling"),
                                                  compiled)]
    return [merge(section, "top-k log-probs", topk_rows) if "topk" in caps else skipped(section, "top-k log-probs"),
            merge(section, "tree build", tree_rows) if "tree" in caps else skipped(section, "tree build"),
            merge(section, "tree compile", compile_rows) if "compile" in caps else skipped(section, "tree compile")]


def compare_tree(section: str, built: tuple, expected: tuple, where: str) -> list[Check]:
    """An adapter's (parents, tokens, depths[, scores]) against the fixture's, all bit-exact."""
    names = ("parents", "tokens", "depths", "scores")
    return [compare_exact(section, what, got, want, where) for what, got, want in zip(names, built, expected)]


def _words(bits: Any) -> np.ndarray:
    """Visibility words as unsigned 32-bit values, whether stored as int32 or uint32."""
    return np.asarray(bits).astype(np.int64) & 0xFFFFFFFF


def _accept_compact_cases(adapter, caps: set[str], reader, section: str) -> list[Check]:
    accept_rows, compact_rows = [], []
    for case in _cases(reader):
        p = f"cases/{case['name']}/"
        where = f"case {case['name']}"
        start = int(case["start"]) if "start" in case else _int(reader[p + "start"])
        accepted_expected = np.asarray(reader[p + "accepted"])
        if "accept" in caps:
            accepted, next_root = adapter.accept(*(np.asarray(reader[p + k]) for k in ("parents", "tokens", "choices")))
            accept_rows += [compare_exact(section, "accepted", accepted, accepted_expected, where),
                            compare_exact(section, "next root", next_root, _int(reader[p + "next_root"]), where)]
        if "compact" in caps:
            c_kv, k_pe = adapter.compact(np.array(reader[p + "c_kv"]), np.array(reader[p + "k_pe"]), start,
                                         accepted_expected)
            compact_rows += [compare_exact(section, "c_kv after", c_kv, np.asarray(reader[p + "c_kv_after"]), where),
                             compare_exact(section, "k_pe after", k_pe, np.asarray(reader[p + "k_pe_after"]), where)]
    return [merge(section, "accept", accept_rows) if "accept" in caps else skipped(section, "accept"),
            merge(section, "KV compaction", compact_rows) if "compact" in caps else skipped(section, "KV compaction")]


def _verify_attention_cases(adapter, caps: set[str], reader, section: str) -> list[Check]:
    if "attention" not in caps:
        return [skipped(section, "verify attention")]
    rule = reader.metadata.get("tolerances", {}).get("o_lat", DEFAULT_ATTENTION_TOLERANCE)
    rows = []
    for case in _cases(reader):
        p = f"cases/{case['name']}/"
        q_lat, q_pe, c_kv, k_pe, context, trees, q_off, kv_off, bits, expected = (
            np.asarray(reader[p + k]) for k in ("q_lat", "q_pe", "c_kv", "k_pe", "context", "tree_sizes",
                                                "q_offsets", "kv_offsets", "visibility_bits", "o_lat"))
        scale = float(case["scale"]) if "scale" in case else float(reader.metadata["scale"])
        for b in range(len(context)):
            q = slice(int(q_off[b]), int(q_off[b + 1]))
            n, ctx = int(trees[b]), int(context[b])
            kv = slice(int(kv_off[b]), int(kv_off[b]) + ctx + n)
            visibility = np.concatenate([np.ones((n, ctx), dtype=bool), unpack_bits(bits[q], n)], axis=1)
            o_lat = adapter.attention(q_lat[q], q_pe[q], c_kv[kv], k_pe[kv], visibility, scale)
            rows.append(compare_close(section, "verify attention", o_lat, expected[q], rule["rtol"], rule["atol"],
                                      f"case {case['name']} request {b}"))
    return [merge(section, "verify attention (o_lat)", rows)]


_KERNEL_CASES: dict[str, Callable[..., list[Check]]] = {
    "tree_build": _tree_build_cases,
    "accept_compact": _accept_compact_cases,
    "verify_attention": _verify_attention_cases,
}


def write_json(report: Report, path: str | os.PathLike) -> None:
    """The report as JSON, written atomically (a temporary file, then a rename)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ValidateError(f"--json {path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report.to_dict(), f, indent=2, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
