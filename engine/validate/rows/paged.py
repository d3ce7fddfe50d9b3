"""Paged-KV rows (protocol v2 only): the `paged_kv` kernel cases through an adapter's
`paged_attention` and `paged_compact` (door/protocol_v2.py), one call per case with every
request of the case in it.

- "paged verify attention": each request's o_lat by kernel.AttentionRule: float32
  inputs against `o_lat` by the fixture's tolerance, or under `--dtype bfloat16` the inputs
  rounded to bf16 against `o_lat_bf16` by its `tolerances_bf16`. A failure names the case
  and the request.
- "paged KV compaction": both pools after the call, bit for bit. A differing page is
  named by who reads it. A correct compaction writes only request b's slots starts[b] ..
  starts[b] + a_b - 1, all in its own pages, so a change to a page two requests share
  reads "compaction wrote page p, which request r reads (...)", one to a page no request
  holds "compaction wrote page p, which no request holds", one to a request's own page
  outside its moved slots the first with the slot; a moved slot holding the wrong row is
  a wrong move. The first of those, in that order, is the row's detail.

A protocol 1 adapter is handed one request's numpy arrays and has no pages: for it both rows are
skipped rows saying so.
"""

from __future__ import annotations

import numpy as np
import torch

from ..door.checked import CheckedV2, fault_into
from ..judging.compare import row
from ..reports.report import Check, Status
from .batched import Request, host, put, split, words32
from .kernel import AttentionRule

PAGED_KIND = "paged_kv"
ATTENTION, COMPACTION = "paged verify attention", "paged KV compaction"
PAGED_ROWS: dict[str, set[str]] = {ATTENTION: {"paged_attention"}, COMPACTION: {"paged_compact"}}
NEEDS_V2 = "skipped (paged KV needs protocol 2: a protocol 1 adapter is handed one request's numpy arrays, " \
           "without pages)"


def paged_checks(adapter: CheckedV2 | None, caps: set[str], reader, section: str,
                 dtype: str = "float32") -> list[Check]:
    """The rows of a paged_kv fixture (PAGED_ROWS, in that order); adapter None: a v1 adapter."""
    if adapter is None:
        return [Check(section, name, Status.SKIPPED, detail=NEEDS_V2, needs=tuple(sorted(needs)))
                for name, needs in PAGED_ROWS.items()]
    found: dict[str, list[Check]] = {name: [] for name in PAGED_ROWS}
    for case in reader.metadata.get("cases", []):
        request = Request(f"case {case['name']}", reader, f"cases/{case['name']}/", meta=case)
        if case["op"] not in ("attention", "compact"):
            raise ValueError(f"{request.where}: unknown paged op {case['op']!r} (attention, compact)")
        if case["op"] == "attention" and "paged_attention" in caps:
            rule = AttentionRule.of(reader.metadata, request.has("o_lat_bf16"), dtype)
            _attention(adapter, section, request, rule, found[ATTENTION])
        elif case["op"] == "compact" and "paged_compact" in caps:
            _compaction(adapter, section, request, found[COMPACTION])
    return [row(section, name, needs, caps, found[name]) for name, needs in PAGED_ROWS.items()]


def _attention(adapter: CheckedV2, section: str, case: Request, rule: AttentionRule, rows: list[Check]) -> None:
    """One paged_attention call for the case's batch; each request's o_lat [n_b, H, R] by `rule`."""
    with fault_into(rows, section, ATTENTION, case.where):
        o_lat = adapter.paged_attention(*(put(adapter, rule.inputs(case[w]))
                                          for w in ("q_lat", "q_pe", "c_kv_pages", "k_pe_pages")),
                                        put(adapter, case["block_table"], torch.int32),
                                        put(adapter, case["q_offsets"], torch.int64),
                                        put(adapter, case["context"], torch.int64),
                                        put(adapter, words32(case["visibility_bits"])), float(case.meta["scale"]))
        bounds = case["q_offsets"]
        for b, (got, want) in enumerate(zip(split(host(o_lat), bounds), split(case[rule.expected], bounds))):
            rows.append(rule.compare(section, "paged verify attention", got, want, f"{case.where} request {b}"))


def _compaction(adapter: CheckedV2, section: str, case: Request, rows: list[Check]) -> None:
    """One paged_compact call for the case's batch; both pools against the fixture's, bit for bit."""
    with fault_into(rows, section, COMPACTION, case.where):
        pools = adapter.paged_compact(put(adapter, case["c_kv_pages"]), put(adapter, case["k_pe_pages"]),
                                      put(adapter, case["block_table"], torch.int32),
                                      *(put(adapter, case[w], torch.int64) for w in ("starts", "accepted",
                                                                                     "accept_offsets")))
        rows.append(_pools_check(section, case, [host(pool) for pool in pools],
                                 [case["c_kv_after"], case["k_pe_after"]]))


def _pools_check(section: str, case: Request, got: list[np.ndarray], want: list[np.ndarray]) -> Check:
    """EXACT when both pools [P, page, w] match; else FAIL naming the most telling differing page."""
    differ = np.zeros(want[0].shape[:2], dtype=bool)                                # [P, page] slots that differ
    for actual, expected in zip(got, want):
        differ |= (actual != expected).any(axis=2)
    pages = np.flatnonzero(differ.any(axis=1))
    if not pages.size:
        return Check(section, COMPACTION, Status.EXACT)
    table, starts = case["block_table"], case["starts"]
    moved = [range(int(starts[b]), int(starts[b]) + len(path))
             for b, path in enumerate(split(case["accepted"], case["accept_offsets"]))]
    telling = min((_wrong_page(int(p), np.flatnonzero(differ[p]), differ.shape[1], table, moved) for p in pages),
                  key=lambda found: found[0])
    return Check(section, COMPACTION, Status.FAIL,
                 detail=f"{pages.size} of {len(differ)} pages differ; {telling[1]} ({case.where})")


def _wrong_page(page: int, rows: np.ndarray, page_size: int, table: np.ndarray,
                moved: list[range]) -> tuple[int, str]:
    """-> (rank, words) for a page whose `rows` differ: 0 a page shared or held by no request,
    1 a request's own page changed outside its moved slots, 2 a wrong move."""
    holders = [b for b in range(len(table)) if page in table[b]]
    if not holders:
        return 0, f"compaction wrote page {page}, which no request holds"
    if len(holders) > 1:
        return 0, (f"compaction wrote page {page}, which request {holders[0]} reads (a page requests "
                   f"{', '.join(map(str, holders))} share)")
    b = holders[0]
    slots = [int(np.flatnonzero(table[b] == page)[0]) * page_size + int(r) for r in rows]
    outside = [s for s in slots if s not in moved[b]]
    span = f"{moved[b].start} .. {moved[b].stop - 1}" if len(moved[b]) else "none"
    if outside:
        return 1, (f"compaction wrote page {page}, which request {b} reads, at its slot {outside[0]} "
                   f"(outside its moved slots: {span})")
    return 2, f"request {b}'s moved slot {slots[0]} (page {page}) holds the wrong row (moved slots {span})"
