"""Where an optional package is absent, the tests that need it skip with a reason naming it, never error.

Each case runs the test modules that use one package in a child pytest with that package hidden
(tests/without/sitecustomize.py: every import finder answers None for it, as where it is not
installed) and reads the child's JUnit XML: no error, no failure, and every skip's reason names
the package.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from terminal import environment

TESTS = Path(__file__).parent
# import name -> (the names a skip reason may call it by, the tests that use it)
OPTIONAL = {
    "compressed_tensors": (("compressed-tensors", "compressed_tensors"),
                           ["refgen/test_checkpoint_import.py", "engine/test_checkpoint_fixture.py"]),
    "transformers": (("transformers",),
                     ["engine/test_hf_adapter.py", "refgen/test_checkpoint_hf.py",
                      "refgen/test_model.py::test_model_matches_hf_transformers",
                      "test_schema.py::test_transformers_own_deepseek_v3_config_round_trips"]),
    "scipy": (("scipy",), ["engine/test_sampling.py",
                           "refgen/test_decode.py::test_sampling_has_the_ar_sampling_distribution"]),
    "xmlschema": (("xmlschema",), ["engine/test_reports.py::test_junit_xml_has_one_testcase_per_row_and_passes_the_schema"]),
    "matplotlib": (("matplotlib",), ["engine/test_reports.py", "engine/test_cli.py::test_demo_runs_and_plots"]),
    "gguf": (("gguf",), ["refgen/test_export_gguf.py"]),
}


def outcomes(report: Path) -> list[tuple[str, str, str]]:
    """A JUnit XML report -> (test, outcome, message and text) per test case; outcome: passed,
    skipped, failure or error."""
    cases = []
    for case in ElementTree.parse(report).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        marks = [child for child in case if child.tag in ("skipped", "failure", "error")]
        mark = marks[0] if marks else None
        cases.append((test, mark.tag, f"{mark.get('message', '')} {mark.text or ''}") if marks else
                     (test, "passed", ""))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("package", sorted(OPTIONAL))
def test_an_absent_optional_package_skips_its_tests_with_its_name(package, tmp_path):
    names, tests = OPTIONAL[package]
    report = tmp_path / "report.xml"
    env = environment({"KDTREE_WITHOUT": package})
    env["PYTHONPATH"] = f"{TESTS / 'without'}:{env['PYTHONPATH']}"
    run = subprocess.run([sys.executable, "-m", "pytest", *(str(TESTS / t) for t in tests), "-p", "no:cacheprovider",
                          "-q", f"--junit-xml={report}"],
                         capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=600)
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    cases = outcomes(report)
    broken = [c for c in cases if c[1] in ("failure", "error")]
    assert not broken, "\n".join(f"{test}: {outcome}: {message}" for test, outcome, message in broken)
    skipped = [c for c in cases if c[1] == "skipped"]
    assert skipped, f"no test skipped with {package} hidden: {cases}"
    unnamed = [c for c in skipped if not any(name in c[2] for name in names)]
    assert not unnamed, unnamed
