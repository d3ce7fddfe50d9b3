"""scripts/ncu_source_summary.py on a hand-written `ncu --page source --csv` export: two kernels,
each a header line, a column row and its SASS rows (numbers may carry thousands separators)."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ncu_source_summary.py"
spec = importlib.util.spec_from_file_location("ncu_source_summary", SCRIPT)
summary = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look their module up
spec.loader.exec_module(summary)

COLUMNS = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
           '"stall_long_sb","stall_wait","stall_long_sb (Not Issued)"')
EXPORT = "\n".join([
    '"Kernel Name","void first_kernel<int>(Params)"',
    COLUMNS,
    '"0x10","      FFMA R1, R2, R3, R4","10","1,000","0","10","0"',
    '"0x20","      @!P0  BRA 0x10","30","3,000","30","0","30"',
    '"0x30","      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24","60","1,000","45","15","45"',
    '"Kernel Name","second_kernel(Params)"',
    COLUMNS,
    '"0x10","      MUFU.EX2 R1, R2","4","2,000","1","3","1"',
    "",
])


def test_each_kernel_reads_with_its_rows(tmp_path):
    path = tmp_path / "source.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(EXPORT)
    first, second = summary.read_kernels(str(path))
    assert (first.name, len(first.rows)) == ("void first_kernel<int>(Params)", 3)
    assert (second.name, len(second.rows)) == ("second_kernel(Params)", 1)
    assert first.total("Instructions Executed") == 5000                     # "3,000" is 3000
    assert summary.opcode(first.rows[1]["Source"]) == "BRA"                 # the predicate is not the opcode


def test_the_summary_gives_shares_mix_and_the_most_stalled(tmp_path):
    path = tmp_path / "source.csv"
    path.write_text(EXPORT)
    text = summary.summarize(summary.read_kernels(str(path))[0], top=1)
    assert "executed 0.0 M warp instructions; 100 samples" in text
    assert "stalls: long_sb 0.750, wait 0.250" in text                       # Not Issued columns left out
    assert "executed: BRA 0.600, FFMA 0.200, HGMMA 0.200" in text
    (listed,) = [line for line in text.splitlines() if "60.00%" in line]     # top=1: the HGMMA alone
    assert listed.split()[0] == "2" and "HGMMA" in listed and listed.endswith("long_sb 45, wait 15")
    assert "BRA 0x10" not in text


def test_a_file_that_is_not_an_export_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    for content in (b"no kernels here\n", b"\xfd7zXZ\x00"):                   # text without a kernel, binary
        path = tmp_path / "x.csv"
        path.write_bytes(content)
        monkeypatch.setattr(sys, "argv", ["ncu_source_summary.py", str(path)])
        with pytest.raises(SystemExit) as exit_:
            summary.main()
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("not an `ncu --page source --csv` export" in err or "cannot read" in err)
