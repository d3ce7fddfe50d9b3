"""The corpus (`kernels/corpus.kdtr`, refgen/corpus.py): one case per shipped bug.

Each case runs only its own stages through the adapter and becomes one row, named by
what it checks, "corpus <case>: <its stages>" (`corpus token_zero: top-k, tree build,
accept`): a case was made for one bug, but other bugs of its stages fail it too. A
FAIL's detail names each failing stage and what differs there. Stages an adapter does
not implement are named in the row's detail as skipped; a case with none left is a
skipped row. The stages (refgen/corpus.py):

- topk: ids exact, lp within one float32 ulp, -inf exactly where the reference has it;
- topk_error: draft logits holding NaN must raise; a returned top-k is a FAIL;
- own_tree: the tree built from the adapter's own top-k is a valid tree (`tree_problems`);
- tree, compile, compact: exact, as the kernel cases;
- accept: exact, and never shorter than the tree's own rank-0 chain accepts.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ..door.checked import AdapterFault
from ..judging.compare import as_int, as_words, compare_close, compare_exact, compare_tree, merge
from ..reports.report import Check, Status

STAGE_CAPABILITIES = {"topk": {"topk"}, "topk_error": {"topk"}, "own_tree": {"topk", "tree"}, "tree": {"tree"},
                      "compile": {"compile"}, "accept": {"accept"}, "compact": {"compact"}}
STAGE_WORDS = {"topk": "top-k", "topk_error": "top-k refuses NaN", "own_tree": "a valid tree from its own top-k",
               "tree": "tree build", "compile": "tree compile", "accept": "accept", "compact": "KV compaction"}


class _Case:
    """One case's tensors (cases/{name}/...), metadata, and where its rows go."""

    def __init__(self, reader, meta: Mapping[str, Any], section: str) -> None:
        self.reader, self.meta, self.section = reader, meta, section
        self.row = row_name(meta)
        self.where = f"case {meta['name']}"

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.reader[f"cases/{self.meta['name']}/{name}"])

    def exact(self, what: str, actual: Any) -> Check:
        return compare_exact(self.section, what, actual, self[what], self.where)

    def fail(self, detail: str) -> Check:
        return Check(self.section, self.row, Status.FAIL, detail=f"{detail} ({self.where})")


def compare_logprobs(section: str, name: str, actual: Any, expected: np.ndarray, where: str) -> Check:
    """Top-k log-probs: -inf exactly where expected has it, finite values within one float32 ulp."""
    actual = np.asarray(actual)
    if actual.shape != expected.shape:
        return compare_exact(section, name, actual, expected, where)
    masked = np.isneginf(expected)
    if not np.array_equal(np.isneginf(actual), masked):
        index = list(map(int, np.argwhere(np.isneginf(actual) != masked)[0]))
        return Check(section, name, Status.FAIL, detail=f"-inf at {index}: got {actual[tuple(index)]}, expected "
                                                        f"{expected[tuple(index)]} ({where})")
    finite = expected[~masked]
    return compare_close(section, name, actual[~masked], finite, 0.0,
                         np.spacing(np.abs(finite).astype(np.float32)), where)


def tree_problems(parents: Any, tokens: Any, depths: Any, budget: int, depth: int, k: int, vocab: int) -> list[str]:
    """What makes (parents, tokens, depths) an invalid DDTree for this budget, depth L, top-k
    width k and vocabulary (empty when valid): node 0 the root (parent -1, depth 0), every
    parent before its child, depths one more than the parent's and at most L, tokens in
    [0, V), siblings distinct, and min(budget, every possible node) nodes."""
    parents, tokens, depths = (np.asarray(a) for a in (parents, tokens, depths))
    if parents.ndim != 1 or parents.shape != tokens.shape or parents.shape != depths.shape or not len(parents):
        return [f"parents, tokens, depths have shapes {parents.shape}, {tokens.shape}, {depths.shape}"]
    if parents[0] != -1 or depths[0] != 0:
        return [f"node 0 is not a root (parent {parents[0]}, depth {depths[0]})"]
    problems = []
    nodes = np.arange(1, len(parents))
    orphans = nodes[(parents[1:] < 0) | (parents[1:] >= nodes)]
    if orphans.size:
        problems.append(f"node {int(orphans[0])}'s parent does not come first")
    elif (depths[1:] != depths[parents[1:]] + 1).any() or (depths > depth).any():
        problems.append("depths are not one more than the parent's, within L")
    if ((tokens[1:] < 0) | (tokens[1:] >= vocab)).any():
        problems.append(f"a token outside [0, {vocab})")
    seen: dict[tuple[int, int], int] = {}
    for i in nodes:
        key = (int(parents[i]), int(tokens[i]))
        if key in seen:
            problems.append(f"siblings with the same token: nodes {seen[key]} and {i} (token {key[1]})")
            break
        seen[key] = int(i)
    possible = sum(k ** d for d in range(1, depth + 1))
    if len(parents) - 1 != min(budget, possible):
        problems.append(f"{len(parents) - 1} nodes, expected min(budget {budget}, {possible} possible)")
    return problems


def _topk(adapter, case: _Case) -> list[Check]:
    lp, ids = adapter.topk_logprobs(case["draft_logits"], int(case.meta["k"]))
    return [case.exact("topk_id", ids), compare_logprobs(case.section, "topk_lp", lp, case["topk_lp"], case.where)]


def _topk_error(adapter, case: _Case) -> list[Check]:
    try:
        adapter.topk_logprobs(case["draft_logits"], int(case.meta["k"]))
    except AdapterFault as fault:
        if fault.raised:        # any explicit error of the adapter's own meets the contract
            return [Check(case.section, case.row, Status.EXACT, detail=str(fault))]
        return [case.fail(f"returned a top-k the protocol forbids for draft logits holding NaN: {fault}; "
                          "the contract requires an explicit error")]
    return [case.fail("returned a top-k for draft logits holding NaN; the contract requires an explicit error")]


def _own_tree(adapter, case: _Case) -> list[Check]:
    meta = case.meta
    lp, ids = adapter.topk_logprobs(case["draft_logits"], int(meta["k"]))
    parents, tokens, depths, *_ = adapter.build_tree(lp, ids, int(meta["budget"]), -1)
    k = min(int(meta["k"]), int(meta["vocab"]))
    problems = tree_problems(parents, tokens, depths, int(meta["budget"]), int(meta["depth"]), k, int(meta["vocab"]))
    if problems:
        return [case.fail(f"the tree from the adapter's own top-k is invalid: {'; '.join(problems)}")]
    return [Check(case.section, case.row, Status.EXACT)]


def _tree(adapter, case: _Case) -> list[Check]:
    built = adapter.build_tree(case["topk_lp"], case["topk_id"], int(case.meta["budget"]), -1)
    return compare_tree(case.section, built, tuple(case[w] for w in ("parents", "tokens", "depths", "scores")),
                        case.where)


def _compile(adapter, case: _Case) -> list[Check]:
    positions, bits, first_child, next_sibling = adapter.compile_tree(case["parents"], case["depths"],
                                                                      int(case.meta["start"]))
    return [case.exact("positions", positions),
            compare_exact(case.section, "visibility_bits", as_words(bits), as_words(case["visibility_bits"]), case.where),
            case.exact("first_child", first_child), case.exact("next_sibling", next_sibling)]


def _accept(adapter, case: _Case) -> list[Check]:
    accepted, next_root = adapter.accept(case["parents"], case["tokens"], case["choices"])
    rows = [case.exact("accepted", accepted),
            compare_exact(case.section, "next root", next_root, as_int(case["next_root"]), case.where)]
    chain = int(case.meta["chain"])
    if len(np.asarray(accepted)) < chain:
        rows.append(case.fail(f"accepted {len(np.asarray(accepted))} tokens, fewer than the {chain} the tree's "
                              f"own rank-0 chain accepts"))
    return rows


def _compact(adapter, case: _Case) -> list[Check]:
    c_kv, k_pe = adapter.compact(case["c_kv"].copy(), case["k_pe"].copy(), int(case.meta["start"]), case["accepted"])
    return [case.exact("c_kv_after", c_kv), case.exact("k_pe_after", k_pe)]


_STAGES: dict[str, Callable[[Any, _Case], list[Check]]] = {
    "topk": _topk, "topk_error": _topk_error, "own_tree": _own_tree, "tree": _tree, "compile": _compile,
    "accept": _accept, "compact": _compact}


def row_name(meta: Mapping[str, Any]) -> str:
    """A case's row, named by what it checks: its name, then its stages."""
    return f"corpus {meta['name']}: {', '.join(STAGE_WORDS[stage] for stage in meta['stages'])}"


def _needs(meta: Mapping[str, Any]) -> set[str]:
    return set().union(*(STAGE_CAPABILITIES[stage] for stage in meta["stages"]))


def corpus_rows(reader) -> list[tuple[str, set[str]]]:
    """The rows corpus_cases returns, in order, before anything runs: (name, needs) per case."""
    return [(row_name(meta), _needs(meta)) for meta in reader.metadata.get("cases", [])]


def corpus_cases(adapter, caps: set[str], reader, section: str) -> list[Check]:
    """One row per corpus case: the worst of its stages' checks, every failure in the detail."""
    rows = []
    for meta in reader.metadata.get("cases", []):
        case = _Case(reader, meta, section)
        needs = _needs(meta)
        checks, missing, failures = [], [], []
        for stage in meta["stages"]:
            if not STAGE_CAPABILITIES[stage] <= caps:
                missing.append(stage)
                continue
            try:
                found = _STAGES[stage](adapter, case)
            except AdapterFault as fault:    # a crash or a forbidden output fails this case, not the fixture
                found = [case.fail(str(fault))]
            checks += found
            failures += [_failure(stage, case, c) for c in found if c.status is Status.FAIL]
        skipped = f"{', '.join(missing)} skipped (not implemented by adapter)" if missing else ""
        if not checks:
            rows.append(Check(section, case.row, Status.SKIPPED, detail=skipped, needs=tuple(sorted(needs))))
            continue
        row = merge(section, case.row, checks, needs)
        row.detail = "; ".join(filter(None, ["; ".join(failures) or row.detail, skipped]))
        rows.append(row)
    return rows


def _failure(stage: str, case: _Case, check: Check) -> str:
    """A failing comparison in the row's detail: its stage, what it compared, what differs."""
    what = "" if check.name == case.row else f" {check.name}"
    return f"{STAGE_WORDS[stage]}{what}: {check.detail}"
