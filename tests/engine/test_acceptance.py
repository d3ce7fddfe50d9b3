"""engine.validate.judging.acceptance: main-path vs sibling acceptance per depth, on hand-made rounds
with hand-counted tables, and on the rows that carry it (checked against the fixture's own
recorded ranks)."""

from __future__ import annotations

import json

import numpy as np

import kdtr_format
import engine.validate.run.runner as runner
from engine.metrics import STAGES
from engine.validate import validate, write_json
from engine.validate.judging.acceptance import account

#   0 ── 1 ── 3 ── 5        node 1 is the root's rank-0 child, node 2 its rank-1 sibling
#    └── 2 ── 4
PARENTS = np.array([-1, 0, 0, 1, 2, 3])


def test_counts_per_depth_split_by_the_walk_so_far():
    table = account([(PARENTS, [0, 1, 3]),      # main, main, then refused at node 3 (which has a child)
                     (PARENTS, [0, 2, 4]),      # a sibling, then main after it; node 4 is a leaf
                     (PARENTS, [0]),            # refused at the root
                     (np.array([-1]), [0])])    # a root-only tree: nothing offered
    assert table.offered.tolist() == [[3, 1, 1], [0, 1, 0]]
    assert table.main.tolist() == [[1, 1, 0], [0, 1, 0]]
    assert table.sibling.tolist() == [[1, 0, 0], [0, 0, 0]]
    assert table.ranks == [[0, 0], [1, 0], [], []]
    assert table.rates() == {"main path": (2, 5), "sibling at the first mismatch": (1, 3), "after a sibling": (1, 1)}
    assert table.summary() == ("acceptance: main path 2/5 (40%), sibling at the first mismatch 1/3 (33%), "
                               "after a sibling 1/1 (100%)")
    assert table.to_dict()["per_depth"]["after_sibling"] == {"offered": [0, 1, 0], "main": [0, 1, 0],
                                                             "sibling": [0, 0, 0]}


def fixture_counts(reader) -> tuple[int, int, int]:
    """(main-path accepted, main-path offered, first-mismatch siblings) of the fixture's greedy
    traces, from the ranks the fixture records for every node."""
    main = offered = sibling = 0
    for t in (t for t in reader.metadata["traces"] if t["ddtree"].get("temperature", 0.0) == 0.0):
        for r in range(t["rounds"]):
            p = f"traces/{t['name']}/rounds/{r}/"
            parents, ranks, path = (np.asarray(reader[p + k]) for k in ("parents", "ranks", "accepted"))
            for k, node in enumerate(path):
                if not (parents == node).any():
                    break
                offered += 1
                if k + 1 == len(path):
                    break
                if ranks[path[k + 1]] != 0:
                    sibling += 1
                    break
                main += 1
    return main, offered, sibling


def test_the_rows_carry_it(golden, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "PRESETS", {})          # the fixture's presets only (no random-weight runs)
    source = golden / "tiny.kdtr"
    (tmp_path / "tiny.kdtr").symlink_to(source)
    report = validate(None, tmp_path)
    rows = {c.name: c for c in report.checks}
    with kdtr_format.open(source) as reader:
        main, offered, sibling = fixture_counts(reader)
    traces = rows["DDTree tokens"].tables["acceptance"]
    assert traces["rates"]["main path"] == {"accepted": main, "of": offered}
    assert traces["rates"]["sibling at the first mismatch"] == {"accepted": sibling, "of": offered - main}
    assert f"main path {main}/{offered}" in rows["DDTree tokens"].detail
    replay = rows["engine DDTree replay (batched)"].tables["acceptance"]   # the same rounds, batched by block size
    assert {k: v for k, v in replay.items() if k != "accepted_ranks"} == \
        {k: v for k, v in traces.items() if k != "accepted_ranks"}
    assert sorted(replay["accepted_ranks"]) == sorted(traces["accepted_ranks"])
    for drafter in ("oracle", "random", "layerskip"):
        row = rows[f"invariant DDTree == AR ({drafter})"]
        assert "acceptance: main path" in row.detail and row.tables["acceptance"]["rounds"] > 0
        timing = row.tables["stage_seconds"]
        assert timing["device"] == "cpu" and set(timing) == {"device", *STAGES}
    write_json(report, tmp_path / "r.json")
    written = {c["name"]: c for c in json.loads((tmp_path / "r.json").read_text())["checks"]}
    assert written["DDTree tokens"]["tables"]["acceptance"] == traces
