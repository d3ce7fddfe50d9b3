"""Kernel cases (`kernels/*.kdtr`): top-k from draft logits, tree build (float64
scores too) and compile (positions, visibility bits, EAGLE links) bit-exact from the
given top-k, accept and compaction exact (the whole cache, every slot past the committed
ones included), verify attention within tolerance (every request of a case's batch). Every
adapter call goes through the checked adapter; a fault is the FAIL row of its check.
`KERNEL_ROWS` names each kind's rows and the capabilities each needs (the corpus: one row
per case, corpus.corpus_rows).

Verify attention in a regime (`AttentionRule`, shared by the per-request, batched and
paged rows): float32 hands the case's float32 inputs and compares with `o_lat` by the
case's tolerance; bfloat16 hands the inputs rounded to bf16 (as float32 values: what a bf16
kernel loads from them) and compares with `o_lat_bf16`, the float64 result from those
rounded inputs, by `tolerances_bf16`, so a kernel that computes in bf16 is judged on its
arithmetic, not on the rounding of its inputs. A case without `o_lat_bf16` (a fixture of
an older refgen) is judged as in float32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from ..door.checked import fault_into
from ..judging.compare import as_int, as_words, compare_close, compare_exact, compare_tree, row, unpack_bits
from ..reports.report import Check
from .corpus import corpus_cases

DEFAULT_ATTENTION_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
Found = dict[str, list[Check]]           # row name -> the comparisons merged into that row


@dataclass(frozen=True)
class AttentionRule:
    """How a verify-attention row judges in one regime (module docstring)."""

    expected: str               # the fixture tensor the output is compared with
    rtol: float
    atol: float
    regime: str
    bf16_inputs: bool           # the float inputs go in rounded to bf16

    @classmethod
    def of(cls, metadata: Mapping[str, Any], has_bf16_case: bool, dtype: str) -> "AttentionRule":
        if dtype == "bfloat16" and has_bf16_case:
            rule = metadata["tolerances_bf16"]["o_lat"]
            return cls("o_lat_bf16", rule["rtol"], rule["atol"],
                       "bf16: the kernel case's tolerances_bf16 (inputs rounded to bf16)", True)
        rule = metadata.get("tolerances", {}).get("o_lat", DEFAULT_ATTENTION_TOLERANCE)
        return cls("o_lat", rule["rtol"], rule["atol"], "float32: the kernel case's tolerance (float32 inputs)", False)

    def inputs(self, array: np.ndarray) -> np.ndarray:
        """A float input as the adapter gets it in this regime."""
        if not self.bf16_inputs:
            return array
        return np.asarray(array, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    def compare(self, section: str, name: str, actual: Any, expected: Any, where: str) -> Check:
        check = compare_close(section, name, actual, expected, self.rtol, self.atol, where)
        check.regime = self.regime
        return check

KERNEL_ROWS: dict[str, dict[str, set[str]]] = {
    "tree_build": {"top-k log-probs": {"topk"}, "tree build": {"tree"}, "tree compile": {"compile"}},
    "accept_compact": {"accept": {"accept"}, "KV compaction": {"compact"}},
    "verify_attention": {"verify attention (o_lat)": {"attention"}},
}


def _cases(reader) -> list[Mapping[str, Any]]:
    return reader.metadata.get("cases", [])


def _tree_build_cases(adapter, caps: set[str], reader, section: str, found: Found) -> None:
    topk_rows, tree_rows, compile_rows = found["top-k log-probs"], found["tree build"], found["tree compile"]
    for case in _cases(reader):
        p = f"cases/{case['name']}/"
        where = f"case {case['name']}"
        topk_lp, topk_id = np.asarray(reader[p + "topk_lp"]), np.asarray(reader[p + "topk_id"])
        if "topk" in caps and p + "draft_logits" in reader and topk_lp.shape[0] > 0:
            with fault_into(topk_rows, section, "top-k log-probs", where):
                lp, ids = adapter.topk_logprobs(np.asarray(reader[p + "draft_logits"]), topk_id.shape[1])
                topk_rows += [compare_exact(section, "top-k ids", ids, topk_id, where),
                              compare_close(section, "top-k lp", lp, topk_lp, 0.0,
                                            np.spacing(np.abs(topk_lp).astype(np.float32)), where)]
        parents, depths = np.asarray(reader[p + "parents"]), np.asarray(reader[p + "depths"])
        if "tree" in caps:
            with fault_into(tree_rows, section, "tree build", where):
                expected = (parents, np.asarray(reader[p + "tokens"]), depths, np.asarray(reader[p + "scores"]))
                tree_rows += compare_tree(section, adapter.build_tree(topk_lp, topk_id, int(case["budget"]), -1),
                                          expected, where)
        if "compile" in caps:
            with fault_into(compile_rows, section, "tree compile", where):
                compiled = adapter.compile_tree(parents, depths, int(case["start"]))
                compile_rows += [
                    compare_exact(section, what, as_words(got) if what == "visibility_bits" else got,
                                  as_words(reader[p + what]) if what == "visibility_bits" else reader[p + what], where)
                    for what, got in zip(("positions", "visibility_bits", "first_child", "next_sibling"), compiled)]


def _accept_compact_cases(adapter, caps: set[str], reader, section: str, found: Found) -> None:
    accept_rows, compact_rows = found["accept"], found["KV compaction"]
    for case in _cases(reader):
        p = f"cases/{case['name']}/"
        where = f"case {case['name']}"
        start = int(case["start"]) if "start" in case else as_int(reader[p + "start"])
        accepted_expected = np.asarray(reader[p + "accepted"])
        if "accept" in caps:
            with fault_into(accept_rows, section, "accept", where):
                accepted, next_root = adapter.accept(*(np.asarray(reader[p + k])
                                                       for k in ("parents", "tokens", "choices")))
                accept_rows += [compare_exact(section, "accepted", accepted, accepted_expected, where),
                                compare_exact(section, "next root", next_root, as_int(reader[p + "next_root"]), where)]
        if "compact" in caps:
            with fault_into(compact_rows, section, "KV compaction", where):
                c_kv, k_pe = adapter.compact(np.array(reader[p + "c_kv"]), np.array(reader[p + "k_pe"]), start,
                                             accepted_expected)
                compact_rows += [
                    compare_exact(section, "c_kv after", c_kv, np.asarray(reader[p + "c_kv_after"]), where),
                    compare_exact(section, "k_pe after", k_pe, np.asarray(reader[p + "k_pe_after"]), where)]


def _verify_attention_cases(adapter, caps: set[str], reader, section: str, found: Found,
                            dtype: str = "float32") -> None:
    rows = found["verify attention (o_lat)"]
    for case in _cases(reader) if "attention" in caps else []:
        p = f"cases/{case['name']}/"
        rule = AttentionRule.of(reader.metadata, p + "o_lat_bf16" in reader, dtype)
        q_lat, q_pe, c_kv, k_pe = (rule.inputs(np.asarray(reader[p + k])) for k in ("q_lat", "q_pe", "c_kv", "k_pe"))
        context, trees, q_off, kv_off, bits, expected = (
            np.asarray(reader[p + k]) for k in ("context", "tree_sizes", "q_offsets", "kv_offsets", "visibility_bits",
                                                rule.expected))
        scale = float(case["scale"]) if "scale" in case else float(reader.metadata["scale"])
        for b in range(len(context)):
            where = f"case {case['name']} request {b}"
            q = slice(int(q_off[b]), int(q_off[b + 1]))
            n, ctx = int(trees[b]), int(context[b])
            kv = slice(int(kv_off[b]), int(kv_off[b]) + ctx + n)
            visibility = np.concatenate([np.ones((n, ctx), dtype=bool), unpack_bits(bits[q], n)], axis=1)
            with fault_into(rows, section, "verify attention (o_lat)", where):
                o_lat = adapter.attention(q_lat[q], q_pe[q], c_kv[kv], k_pe[kv], visibility, scale)
                rows.append(rule.compare(section, "verify attention", o_lat, expected[q], where))


_KERNEL_CASES: dict[str, Callable[..., None]] = {
    "tree_build": _tree_build_cases,
    "accept_compact": _accept_compact_cases,
    "verify_attention": _verify_attention_cases,
}
KERNEL_KINDS = (*KERNEL_ROWS, "corpus")


def kernel_checks(kind: str, adapter, caps: set[str], reader, section: str, dtype: str = "float32") -> list[Check]:
    """A kernel fixture's rows (KERNEL_ROWS[kind], in that order; the corpus: one per case);
    verify attention in the regime of `dtype` (module docstring)."""
    if kind == "corpus":
        return corpus_cases(adapter, caps, reader, section)
    found: Found = {name: [] for name in KERNEL_ROWS[kind]}
    if kind == "verify_attention":
        _verify_attention_cases(adapter, caps, reader, section, found, dtype)
    else:
        _KERNEL_CASES[kind](adapter, caps, reader, section, found)
    return [row(section, name, needs, caps, found[name]) for name, needs in KERNEL_ROWS[kind].items()]
