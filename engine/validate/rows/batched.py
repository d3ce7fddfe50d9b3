"""Batched checks (protocol v2 only): many requests in one call of the checked v2 adapter,
each request's outputs compared with the same comparisons as the per-request checks.

What they catch that a batch of one cannot: a request reading or writing another's rows
(a leak), ragged offsets taken as if every request had the widest one's size, and the
adapter's compaction of its own cache. The rows are named "batched <check>"; each
comparison says where it is ("trace t1 round 2; request 1 of a batch of 10") so an
offsets bug reads as one.

Stage calls batch what a serving engine batches: top-k takes one call per draft shape
[L, V] with k the largest width among its requests (each request's first K columns
compared); tree build one call per draft depth L, from the fixture's top-k padded to
that k with -inf columns. Padding cannot change a tree when the request's budget is at
most the number of nodes its own K columns can make (a candidate pops only after every
better one, and a padded -inf column after every real one); a request whose budget
exceeds that gets a call of its own. Compile, accept, sample accept, compaction and
attention take every request of the fixture (or the round) in one call.

Model fixtures (batched_model.py) run every trace as one request of one batch, with the
adapter's own cache and compaction, timed per stage. Kernel cases: top-k, tree build and
compile over tree_build's cases; accept and KV compaction (grouped by row widths, caches
zero-padded to the longest; each request's whole cache compared, its padding included, so a
write past its committed slots fails) over accept_compact's; each verify_attention case's
own ragged batch in one attention call, every request's output compared.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ...ragged import pack_visibility
from ..door.checked import CheckedV2, fault_into
from ..judging.compare import as_int, as_words, compare_close, compare_exact, compare_tree, row
from ..reports.report import Check
from .kernel import AttentionRule

Close = Callable[[str, str, Any, Any, str], Check]       # (section, name, actual, expected, where) -> row


@dataclass
class Request:
    """One request of a batched call: where it is in words, and the fixture's tensors under
    `prefix` (what it takes and what it must give) with its scalars."""

    where: str
    reader: Any
    prefix: str
    budget: int = 0
    root: int = -1
    start: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.reader[self.prefix + name])

    def has(self, name: str) -> bool:
        return self.prefix + name in self.reader


def at(request: Request, b: int, batch: int) -> str:
    """Where request b of a call of `batch` requests is, in words."""
    return f"{request.where}; request {b} of a batch of {batch}"


def listing(requests: Sequence[Request]) -> str:
    return ", ".join(r.where for r in requests)


def timed(adapter: CheckedV2, seconds: dict[str, float] | None, stage: str) -> contextlib.AbstractContextManager:
    """The adapter's clock on `stage` when the caller times its calls (seconds not None)."""
    return adapter.timing(seconds, stage) if seconds is not None else contextlib.nullcontext()


def put(adapter: CheckedV2, array: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.tensor(np.asarray(array), dtype=dtype, device=adapter.device)


def offsets(counts: Sequence[int], adapter: CheckedV2) -> torch.Tensor:
    return put(adapter, np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]), torch.int64)


def host(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy()


def split(values: np.ndarray, bounds: np.ndarray) -> Iterator[np.ndarray]:
    """Request b's rows of a ragged output: values[bounds[b]:bounds[b + 1]]."""
    for b in range(len(bounds) - 1):
        yield values[bounds[b]:bounds[b + 1]]


def words32(bits: Any) -> np.ndarray:
    """Visibility words (uint32 or int32) as int32 holding the same bits."""
    return as_words(bits).astype(np.uint32).view(np.int32)


def packed_rows(visibility: Sequence[np.ndarray], adapter: CheckedV2) -> torch.Tensor:
    """Each request's bool [n_b, n_b] visibility, stacked as the call's int32 words [T, W]."""
    width = max(len(v) for v in visibility)
    rows = np.concatenate([np.pad(v, ((0, 0), (0, width - v.shape[1]))) for v in visibility])
    return pack_visibility(put(adapter, rows))


def groups(requests: Sequence[Request], key: Callable[[Request], Any]) -> list[list[Request]]:
    """The requests grouped by key, each group in the requests' order."""
    found: dict[Any, list[Request]] = {}
    for request in requests:
        found.setdefault(key(request), []).append(request)
    return list(found.values())


# ---- one stage over many requests ----

def topk_rows(adapter: CheckedV2, section: str, requests: Sequence[Request], rows: list[Check], close: Close,
              seconds: dict[str, float] | None = None) -> None:
    """`batched top-k log-probs`: one call per draft shape; ids exact, lp by `close`."""
    name = "batched top-k log-probs"
    for group in groups([r for r in requests if r.has("draft_logits")], lambda r: r["draft_logits"].shape):
        widths = [r["topk_id"].shape[1] for r in group]
        if group[0]["draft_logits"].shape[0] == 0 or max(widths) == 0:
            continue
        with fault_into(rows, section, name, listing(group)):
            with timed(adapter, seconds, "topk"):
                lp, ids = adapter.topk_logprobs(put(adapter, np.stack([r["draft_logits"] for r in group])),
                                                max(widths))
            lp, ids = host(lp), host(ids)
            for b, (request, k) in enumerate(zip(group, widths)):
                where = at(request, b, len(group))
                rows += [compare_exact(section, "top-k ids", ids[b, :, :k], request["topk_id"], where),
                         close(section, "top-k lp", lp[b, :, :k], request["topk_lp"], where)]


def _possible(depth: int, k: int) -> int:
    return sum(k ** d for d in range(1, depth + 1))


def build_rows(adapter: CheckedV2, section: str, requests: Sequence[Request], rows: list[Check],
               seconds: dict[str, float] | None = None) -> None:
    """`batched tree build`: one call per draft depth (module docstring), every output exact."""
    def key(r: Request) -> tuple[int, ...]:
        depth, k = r["topk_lp"].shape
        return (depth,) if depth == 0 or r.budget <= _possible(depth, k) else (depth, id(r))

    for group in groups(requests, key):
        depth, k = group[0]["topk_lp"].shape[0], max(r["topk_lp"].shape[1] for r in group)
        lp = np.full((len(group), depth, k), -np.inf, dtype=np.float32)
        ids = np.zeros((len(group), depth, k), dtype=np.int64)
        for b, r in enumerate(group):
            lp[b, :, :r["topk_lp"].shape[1]], ids[b, :, :r["topk_id"].shape[1]] = r["topk_lp"], r["topk_id"]
        with fault_into(rows, section, "batched tree build", listing(group)):
            with timed(adapter, seconds, "build"):
                bounds, *tree = adapter.build_trees(put(adapter, lp), put(adapter, ids),
                                                    put(adapter, [r.budget for r in group], torch.int64),
                                                    put(adapter, [r.root for r in group], torch.int64))
            trees = zip(*(split(host(t), host(bounds)) for t in tree))
            for b, (r, built) in enumerate(zip(group, trees)):
                rows += compare_tree(section, built, tuple(r[w] for w in ("parents", "tokens", "depths", "scores")),
                                     at(r, b, len(group)))


def compile_rows(adapter: CheckedV2, section: str, requests: Sequence[Request], rows: list[Check],
                 seconds: dict[str, float] | None = None) -> None:
    """`batched tree compile`: every request in one call; positions, visibility words (zero past
    a request's own words) and, where the fixture has them, the EAGLE links exact."""
    if not requests:
        return
    counts = [len(r["parents"]) for r in requests]
    with fault_into(rows, section, "batched tree compile", listing(requests)):
        with timed(adapter, seconds, "compile"):
            compiled = adapter.compile_trees(put(adapter, np.concatenate([r["parents"] for r in requests]), torch.int64),
                                             put(adapter, np.concatenate([r["depths"] for r in requests]), torch.int64),
                                             offsets(counts, adapter), put(adapter, [r.start for r in requests],
                                                                          torch.int64))
        bounds = np.concatenate([[0], np.cumsum(counts)])
        positions, bits, first_child, next_sibling = (list(split(host(t), bounds)) for t in compiled)
        for b, r in enumerate(requests):
            where = at(r, b, len(requests))
            want = as_words(r["visibility_bits"])
            want = np.pad(want, ((0, 0), (0, bits[b].shape[1] - want.shape[1]))) if want.shape[1] < bits[b].shape[1] \
                else want
            rows += [compare_exact(section, "positions", positions[b], r["positions"], where),
                     compare_exact(section, "visibility bits", as_words(bits[b]), want, where)]
            rows += [compare_exact(section, link, got[b], r[link], where)
                     for link, got in (("first_child", first_child), ("next_sibling", next_sibling)) if r.has(link)]


def accept_rows(adapter: CheckedV2, section: str, requests: Sequence[Request], rows: list[Check]) -> None:
    """`batched accept` from the fixture's trees and choices, every request in one call."""
    if not requests:
        return
    counts = [len(r["parents"]) for r in requests]
    with fault_into(rows, section, "batched accept", listing(requests)):
        accepted, bounds, next_roots = adapter.accept(
            *(put(adapter, np.concatenate([r[w] for r in requests]), torch.int64) for w in ("parents", "tokens", "choices")),
            offsets(counts, adapter))
        for b, (r, path) in enumerate(zip(requests, split(host(accepted), host(bounds)))):
            where = at(r, b, len(requests))
            rows += [compare_exact(section, "accepted", path, r["accepted"], where),
                     compare_exact(section, "next root", int(next_roots[b]), as_int(r["next_root"]), where)]


def sample_accept_rows(adapter: CheckedV2, section: str, requests: Sequence[Request], temperature: float,
                       rows: list[Check]) -> None:
    """`batched sample accept` from the fixture's verify logits and uniforms, one call."""
    if not requests:
        return
    counts = [len(r["parents"]) for r in requests]
    with fault_into(rows, section, "batched sample accept", listing(requests)):
        choices, accepted, bounds, next_roots = adapter.sample_accept(
            *(put(adapter, np.concatenate([r[w] for r in requests]), torch.int64) for w in ("parents", "tokens")),
            put(adapter, np.concatenate([r["verify_logits"] for r in requests]), torch.float64),
            offsets(counts, adapter), temperature,
            put(adapter, np.concatenate([r["uniforms"] for r in requests]), torch.float64))
        nodes = np.concatenate([[0], np.cumsum(counts)])
        for b, (r, own, path) in enumerate(zip(requests, split(host(choices), nodes), split(host(accepted),
                                                                                             host(bounds)))):
            where = at(r, b, len(requests))
            rows += [compare_exact(section, "choices", own, r["choices"], where),
                     compare_exact(section, "accepted", path, r["accepted"], where),
                     compare_exact(section, "next root", int(next_roots[b]), as_int(r["next_root"]), where)]


# ---- kernel cases ----

def _cases(reader) -> list[Request]:
    requests = []
    for case in reader.metadata.get("cases", []):
        prefix = f"cases/{case['name']}/"
        start = int(case["start"]) if "start" in case else \
            (as_int(reader[prefix + "start"]) if prefix + "start" in reader else 0)
        requests.append(Request(f"case {case['name']}", reader, prefix, int(case.get("budget", 0)), -1, start, case))
    return requests


def _one_ulp(section: str, name: str, actual: Any, expected: Any, where: str) -> Check:
    expected = np.asarray(expected)
    return compare_close(section, name, actual, expected, 0.0, np.spacing(np.abs(expected).astype(np.float32)), where)


def _tree_build_cases(adapter: CheckedV2, caps: set[str], reader, section: str) -> list[Check]:
    cases = _cases(reader)
    found: dict[str, list[Check]] = {"batched top-k log-probs": [], "batched tree build": [],
                                     "batched tree compile": []}
    if "topk" in caps:
        topk_rows(adapter, section, cases, found["batched top-k log-probs"], _one_ulp)
    if "tree" in caps:
        build_rows(adapter, section, cases, found["batched tree build"])
    if "compile" in caps:
        compile_rows(adapter, section, cases, found["batched tree compile"])
    return [row(section, name, {cap}, caps, found[name])
            for name, cap in zip(found, ("topk", "tree", "compile"))]


def _accept_compact_cases(adapter: CheckedV2, caps: set[str], reader, section: str) -> list[Check]:
    cases = _cases(reader)
    accepted: list[Check] = []
    compacted: list[Check] = []
    if "accept" in caps:
        accept_rows(adapter, section, cases, accepted)
    for group in groups(cases, lambda r: (r["c_kv"].shape[1], r["k_pe"].shape[1])) if "compact" in caps else []:
        slots = max(len(r["c_kv"]) for r in group)
        c_kv, k_pe = (np.stack([_padded(r[w], slots) for r in group]) for w in ("c_kv", "k_pe"))
        with fault_into(compacted, section, "batched KV compaction", listing(group)):
            c_kv, k_pe = adapter.compact(put(adapter, c_kv), put(adapter, k_pe),
                                         put(adapter, [r.start for r in group], torch.int64),
                                         put(adapter, np.concatenate([r["accepted"] for r in group]), torch.int64),
                                         offsets([len(r["accepted"]) for r in group], adapter))
            c_kv, k_pe = host(c_kv), host(k_pe)
            for b, r in enumerate(group):       # the whole cache: its zero padding stays zero too
                where = at(r, b, len(group))
                compacted += [compare_exact(section, f"{w} after", got[b], _padded(r[f"{w}_after"], slots), where)
                              for w, got in (("c_kv", c_kv), ("k_pe", k_pe))]
    return [row(section, "batched accept", {"accept"}, caps, accepted),
            row(section, "batched KV compaction", {"compact"}, caps, compacted)]


def _padded(rows: np.ndarray, slots: int) -> np.ndarray:
    """rows [S, w] -> [slots, w], zero rows appended."""
    return np.pad(rows, ((0, slots - len(rows)), (0, 0)))


def _verify_attention_cases(adapter: CheckedV2, caps: set[str], reader, section: str,
                            dtype: str = "float32") -> list[Check]:
    rows: list[Check] = []
    for case in _cases(reader) if "attention" in caps else []:
        rule = AttentionRule.of(reader.metadata, case.has("o_lat_bf16"), dtype)
        scale = float(case.meta["scale"]) if "scale" in case.meta else float(reader.metadata["scale"])
        with fault_into(rows, section, "batched verify attention", case.where):
            o_lat = host(adapter.attention(*(put(adapter, rule.inputs(case[w])) for w in ("q_lat", "q_pe", "c_kv", "k_pe")),
                                           *(put(adapter, case[w], torch.int64)
                                             for w in ("q_offsets", "kv_offsets", "context")),
                                           put(adapter, words32(case["visibility_bits"])), scale))
            bounds = case["q_offsets"]
            for b, (got, want) in enumerate(zip(split(o_lat, bounds), split(case[rule.expected], bounds))):
                rows.append(rule.compare(section, "verify attention", got, want, f"{case.where} request {b}"))
    return [row(section, "batched verify attention", {"attention"}, caps, rows)]


# The rows batched_kernel_checks returns for each kernel kind, in order, with their capabilities (the plan's).
BATCHED_KERNEL_ROWS: dict[str, dict[str, set[str]]] = {
    "tree_build": {"batched top-k log-probs": {"topk"}, "batched tree build": {"tree"},
                   "batched tree compile": {"compile"}},
    "accept_compact": {"batched accept": {"accept"}, "batched KV compaction": {"compact"}},
    "verify_attention": {"batched verify attention": {"attention"}},
}


def batched_kernel_checks(adapter: CheckedV2, caps: set[str], reader, section: str,
                          dtype: str = "float32") -> list[Check]:
    """The batched rows of one kernel fixture (none for a kind without batched rows: the corpus)."""
    kind = reader.metadata.get("kind")
    if kind == "verify_attention":
        return _verify_attention_cases(adapter, caps, reader, section, dtype)
    checks = {"tree_build": _tree_build_cases, "accept_compact": _accept_compact_cases}.get(kind)
    return checks(adapter, caps, reader, section) if checks else []
