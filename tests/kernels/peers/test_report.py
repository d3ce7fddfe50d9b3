"""peers.report judges each issue-34 target by the worst row of its shape, and says when none was measured."""

from __future__ import annotations

import json

from peers.report import judge, main, merge_noa


def chain(context: int, tokens: int, batch: int, ratio: float | None, bw: float = 0.9) -> dict:
    row = dict(context=context, tokens=tokens, batch=batch, kernel_ms=1.0, bw_fraction=bw, mma_fraction=0.5)
    if ratio is None:
        row["flashmla_void"] = "output differs from ours: relative error 5.00e-01 > 0.01"
    else:
        row.update(flashmla_ms=ratio, flashmla_ratio=ratio, flashmla_error=3e-3, flashmla_bw_fraction=0.8)
    return row


def tree(context: int, tokens: int, batch: int, rate: float, sglang: float | None, mma: float = 0.45) -> dict:
    row = dict(context=context, tokens=tokens, batch=batch, kernel="wgmma", kernel_ms=1.0, flops=780e9,
               bw_fraction=0.1, mma_fraction=rate, mma_ms=2.0, mma_fraction_mma=mma)
    if sglang is None:
        row["sglang_extend_void"] = "not timed"
    else:
        row.update(sglang_extend_ms=sglang, sglang_extend_ratio=sglang, sglang_extend_error=2e-3)
    return row


RUN = {"ceilings": {"gpu": "NVIDIA H100 80GB HBM3", "copy_TBps": 3.0, "bf16_TFLOPs": 780.0}, "page_size": 64,
       "chain": [chain(8192, 1, 8, 1.2), chain(32768, 1, 32, 0.95), chain(1024, 1, 8, 0.1, bw=0.2),
                 chain(8192, 1, 1, 0.85), chain(8192, 4, 8, 0.92), chain(1024, 16, 1, None)],
       "tree": [tree(8192, 64, 8, 0.70, 12.0), tree(32768, 128, 8, 0.66, None), tree(1024, 16, 8, 0.30, 9.5, mma=0.2)]}


def test_each_target_takes_its_worst_row() -> None:
    got = {v.target.text: (v.status, v.worst and (v.worst["context"], v.worst["tokens"], v.worst["batch"]),
                           v.measured, v.expected) for v in judge(RUN)}
    assert got == {
        # ctx 1k and batch 1 rows are outside this target's shape: 0.95x at ctx 32k / batch 32 is the worst
        "decode, batch >= 8, context >= 8k: >= 1.0x FlashMLA": ("NOT MET", (32768, 1, 32), 2, 2),
        "decode, batch >= 8, context >= 8k: >= 85% of the copy bandwidth": ("met", (8192, 1, 8), 2, 2),
        "decode, batch 1, context >= 8k: >= 0.8x FlashMLA": ("met", (8192, 1, 1), 1, 1),
        # the void chain is counted as expected but not measured
        "causal chains of 2-16 tokens: >= 0.9x FlashMLA at every shape": ("met", (8192, 4, 8), 1, 2),
        "trees of 16-128 tokens, context >= 8k: >= 65% of the bf16 rate": ("met", (32768, 128, 8), 2, 2),
        "trees of 16-128 tokens: >= 10x SGLang's extend kernel at every case": ("NOT MET", (1024, 16, 8), 2, 3),
        # no no-sm_90a run given: the fat library's mma column does not stand in for it
        "mma.sync build (no sm_90a), context >= 8k, 16+ tokens: >= 40% of the bf16 rate": ("not measured", None, 0, 2),
    }


def test_the_no_sm90a_run_judges_the_mma_target_at_the_first_runs_ceiling() -> None:
    # 780 GFLOP in 2.5 ms at the first run's 780 TFLOP/s ceiling is 40%; in 2.6 ms, 38.5%
    noa = {"ceilings": {"bf16_TFLOPs": 1.0}, "tree": [dict(context=8192, tokens=64, batch=8, kernel="mma", kernel_ms=2.5),
                                                      dict(context=32768, tokens=128, batch=8, kernel="mma", kernel_ms=2.6),
                                                      dict(context=1024, tokens=16, batch=8, kernel="wgmma", kernel_ms=0.1)]}
    merged = merge_noa(RUN, noa)
    assert [r.get("noa_ms") for r in merged["tree"]] == [2.5, 2.6, None]     # a row that is not mma.sync is not taken
    verdict = next(v for v in judge(merged) if v.target.figure == "noa_fraction")
    assert (verdict.status, verdict.worst["context"], verdict.measured) == ("NOT MET", 32768, 2)
    assert abs(verdict.worst["noa_fraction"] - 1 / 2.6) < 1e-12
    merged["tree"][1]["noa_fraction"] = 0.40
    assert next(v for v in judge(merged) if v.target.figure == "noa_fraction").status == "met"


def test_a_target_with_no_measured_row_is_not_measured() -> None:
    run = {**RUN, "chain": [chain(8192, 2, 8, None)]}
    verdict = next(v for v in judge(run) if v.target.text.startswith("causal chains"))
    assert (verdict.status, verdict.measured, verdict.expected) == ("not measured", 0, 1)


def test_main_writes_the_tables_and_refuses_a_bad_file(tmp_path, capsys) -> None:
    good = tmp_path / "run.json"
    good.write_text(json.dumps(RUN))
    assert main([str(good)]) == 0
    text = capsys.readouterr().out
    assert "| decode, batch >= 8, context >= 8k: >= 1.0x FlashMLA | NOT MET | ctx 32768 / 1 tokens / batch 32 | 0.95x |" in text
    assert "output differs from ours" in text and "NVIDIA H100 80GB HBM3" in text
    assert "FlashInfer" not in text                                  # no row timed it
    bad = tmp_path / "bad.json"
    bad.write_text("{\"chain\": []}")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err and "ceilings" in err


def test_the_chain_table_has_flashinfers_columns_when_the_run_timed_it(tmp_path, capsys) -> None:
    timed = dict(chain(8192, 4, 8, 0.92), flashinfer="flashinfer-python 0.7.4 (git 77039051b0be) (fa3)",
                 flashinfer_ms=1.5, flashinfer_ratio=1.5, flashinfer_error=2e-3)
    void = dict(chain(8192, 1, 8, 1.2), flashinfer="flashinfer-python 0.7.4 (git 77039051b0be) (fa3)",
                flashinfer_void="RuntimeError: FlashInfer run (fa3): no kernel image")
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**RUN, "chain": [timed, void]}))
    assert main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "## Decode and causal chains: kdtree beside FlashMLA and FlashInfer" in lines
    assert "| 8192 | 4 | 8 | 1.000 | 0.920 | 0.92 | 90.0 | 80.0 | 50.0 | 0.0030 | 1.500 | 1.50 | 0.0020 |" in lines
    decode = next(line for line in lines if line.startswith("| 8192 | 1 |"))
    assert decode.endswith("| - (RuntimeError: FlashInfer run (fa3): no kernel image) | - | - |")
    header = next(line for line in lines if line.startswith("| ctx | tokens | batch | kdtree ms | FlashMLA"))
    assert header.count("|") == lines[lines.index(header) + 1].count("|") == decode.count("|")


def test_a_hopper_run_gets_both_wgmma_kernels_side_by_side(tmp_path, capsys) -> None:
    forced = [dict(chain(8192, 4, 8, 0.92), wgmma_ms=1.0, wgmma_pairs_ms=1.25),
              dict(chain(8192, 1, 8, 1.2), wgmma_ms=2.0, wgmma_pairs_ms=1.6),
              dict(chain(1024, 2, 8, 0.9), wgmma_ms=1.0, wgmma_pairs_ms=1.1)]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**RUN, "chain": forced}))
    assert main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "## The two Hopper kernels, forced" in lines
    summary = next(line for line in lines if line.startswith("One-scorer:"))
    assert summary.endswith("The one-scorer kernel was the faster in 2 of 3 cases (by 1.100-1.25x), "
                            "the seesaw in 1 (by at most 1.250x).")
    assert "| chain | 8192 | 1 | 8 | 2.000 | 1.600 | 0.80 |" in lines
    path.write_text(json.dumps(RUN))                                   # a run without them (not Hopper)
    assert main([str(path)]) == 0
    assert "Hopper kernels" not in capsys.readouterr().out
