"""The pytest plugin in a fresh project: docs/examples/test_against_kdtree.py copied into an
empty directory, the plugin found through the `pytest11` entry point pyproject.toml
declares (a dist-info on the path, as `pip install` leaves it), run in a subprocess pytest
on a few kernel fixtures, against the built-in engine and the numpy example adapter (given
by the conftest docs/ci.md shows) and the broken one (by --kdtree-impl). Every case is a
test with its report row's id, collected in plan order in any process; a FAIL fails with
the row `kdtree validate` prints; -x and --lf behave; bad options are one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.pytest_plugin import assert_passes, pytest_generate_tests
from engine.validate import Check, Status, Validation, plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"
KERNELS = ("accept_compact.kdtr", "corpus.kdtr", "tree_build.kdtr")


@pytest.fixture
def project(golden: Path, tmp_path: Path) -> Path:
    """An empty project holding the example test, a fixture directory of kernel cases, and the
    entry point of pyproject.toml in a dist-info on its path."""
    (tmp_path / "fx" / "kernels").mkdir(parents=True)
    for name in KERNELS:
        (tmp_path / "fx" / "kernels" / name).symlink_to(golden / "kernels" / name)
    (tmp_path / "test_against_kdtree.py").write_text((EXAMPLES / "test_against_kdtree.py").read_text())
    points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    info = tmp_path / "site" / "kdtree_under_test-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kdtree-under-test\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    return tmp_path


def pytest_run(project: Path, *args: str, hash_seed: str = "1") -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": f"{REPO}{os.pathsep}{project / 'site'}",
           "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": hash_seed, "HOME": str(project), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "pytest", "--kdtree-fixtures", "fx", "-q", *args], cwd=project,
                          env=env, capture_output=True, text=True, timeout=600)


def outcomes(path: Path) -> dict[str, str]:
    """pytest's own junit-xml: test id -> passed | failed | skipped (in the order run)."""
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kind = [e.tag for e in case if e.tag in ("failure", "error", "skipped")]
        found[case.get("name")[len("test_against_kdtree["):-1]] = {"failure": "failed", "error": "error",
                                                                   "skipped": "skipped"}.get(kind[0] if kind else "",
                                                                                             "passed")
    return found


def expected(validation: Validation, cases) -> dict[str, str]:
    """What each case's row makes of its test."""
    judged = {Status.FAIL: "failed", Status.SKIPPED: "skipped", Status.NEAR_TIE: "skipped"}
    return {c.id: judged.get(validation.check(c).status, "passed") for c in cases}


def summary(result: subprocess.CompletedProcess) -> str:
    return result.stdout.strip().splitlines()[-1]


def test_the_built_in_engine_passes_every_kernel_case(project):
    """The built-in engine, the plugin named with -p as well as by the entry point (loaded once)."""
    cases = [c for c in plan(project / "fx") if c.section.startswith("kernels/")]
    run = pytest_run(project, "-p", "engine.pytest_plugin", "-k", "kernels", "--junitxml=out.xml",
                     "--kdtree-require", "topk,tree,compile,accept,compact", "-W", "error::pytest.PytestWarning")
    assert run.returncode == 0, run.stdout + run.stderr
    assert list(outcomes(project / "out.xml")) == [c.id for c in cases]
    assert re.fullmatch(rf"{len(cases)} passed, \d+ deselected in .*", summary(run)), summary(run)


def test_the_numpy_adapter_through_the_documented_conftest(project):
    """Every case, in plan order (this process's hash seed is not the subprocess's), each the
    outcome of its row; the conftest is the one docs/ci.md shows."""
    conftest = re.search(r"```python\n(# conftest\.py\n.*?)```", (REPO / "docs" / "ci.md").read_text(), re.S)
    (project / "conftest.py").write_text(conftest.group(1))
    (project / "numpy_adapter.py").write_text((EXAMPLES / "numpy_adapter.py").read_text())
    require = "topk,tree,accept,compact"
    run = pytest_run(project, "--junitxml=out.xml", "--kdtree-require", require, hash_seed="2")
    assert run.returncode == 0, run.stdout + run.stderr
    sys.path.insert(0, str(EXAMPLES))
    try:
        from numpy_adapter import NumpyAdapter
    finally:
        sys.path.remove(str(EXAMPLES))
    cases = plan(project / "fx")
    want = expected(Validation(NumpyAdapter(), project / "fx", require=require), cases)
    assert outcomes(project / "out.xml") == want and list(outcomes(project / "out.xml")) == list(want)
    assert {"validate::capability tree", "validate::any check ran"} <= {k for k, v in want.items() if v == "passed"}
    assert want["kernels/tree_build.kdtr::tree compile"] == "skipped"


def test_a_failing_case_fails_with_the_row_and_x_and_lf_behave(project):
    sys.path.insert(0, str(EXAMPLES))
    try:
        from broken_adapter import BrokenTieAdapter
    finally:
        sys.path.remove(str(EXAMPLES))
    impl = ("--kdtree-impl", f"{EXAMPLES / 'broken_adapter.py'}:BrokenTieAdapter", "--kdtree-require", "topk,tree")
    validation = Validation(BrokenTieAdapter(), project / "fx", require="topk,tree")
    cases = plan(project / "fx")
    failed = [c for c in cases if validation.check(c).status is Status.FAIL]
    assert [c.name for c in failed] == ["corpus token_zero: top-k, tree build, accept",
                                        "corpus budget_beyond_possible: tree build", "tree build"]

    first = pytest_run(project, "-x", *impl)
    before = [expected(validation, [c])[c.id] for c in cases[:cases.index(failed[0])]]   # the cases run before it
    counts = ", ".join(f"{before.count(kind)} {kind}" for kind in ("passed", "skipped") if kind in before)
    assert first.returncode == 1 and re.fullmatch(rf"1 failed, {counts} in .*", summary(first)), first.stdout
    assert f"_ test_against_kdtree[{failed[0].id}] _" in first.stdout
    assert validation.check(failed[0]).text() in first.stdout           # the row as `kdtree validate` prints it
    rerun = pytest_run(project, "--lf", *impl)
    assert re.fullmatch(r"1 failed in .*", summary(rerun)), summary(rerun)        # that case alone
    assert f"_ test_against_kdtree[{failed[0].id}] _" in rerun.stdout


def test_bad_options_are_one_line_without_a_traceback(project):
    run = pytest_run(project, "--kdtree-fixtures", "no/such/dir")
    assert run.returncode == 2                                  # a collection error
    assert "\nkdtree: fixture directory or file no/such/dir does not exist\n" in run.stdout, run.stdout
    bad = pytest_run(project, "-k", "accept_compact", "--kdtree-impl", "no_such_module_xyz:make")
    assert bad.returncode == 1
    assert "\nkdtree: --kdtree-impl 'no_such_module_xyz:make': cannot import" in bad.stdout, bad.stdout
    for out in (run.stdout, bad.stdout):                        # the message alone, no traceback, no chain
        assert not re.search(r"Traceback|During handling|\.py:\d+", out.split("short test summary")[0]), out


def test_a_kdtree_adapter_fixture_that_returns_none_is_an_error(project):
    """A conftest fixture that forgets its `return` does not check the built-in engine instead."""
    (project / "conftest.py").write_text("import pytest\n\n\n@pytest.fixture(scope='session')\n"
                                         "def kdtree_adapter():\n    adapter = object()\n")
    run = pytest_run(project, "-k", "accept_compact")
    assert run.returncode == 1 and " passed" not in summary(run), run.stdout
    assert "\nkdtree: the kdtree_adapter fixture returned None, expected the adapter under test" in run.stdout, \
        run.stdout


def test_a_kdtree_impl_factory_that_returns_none_is_an_error(project):
    """--kdtree-impl naming a factory that returns None does not check the built-in engine instead."""
    (project / "forgets.py").write_text("def make():\n    adapter = object()\n")
    run = pytest_run(project, "--kdtree-impl", "forgets.py:make", "-k", "accept_compact")
    assert run.returncode == 1 and " passed" not in summary(run), run.stdout
    assert "--kdtree-impl 'forgets.py:make'" in run.stdout and "returned None" in run.stdout, run.stdout


def test_the_plugin_runs_on_one_thread_as_the_cli_does_and_shows_progress(project):
    (project / "conftest.py").write_text("import torch\n\ntorch.set_num_threads(2)\n")
    (project / "test_threads.py").write_text("import torch\n\n\ndef test_threads(kdtree_case):\n"
                                             "    assert torch.get_num_threads() == 1\n")
    run = pytest_run(project, "test_threads.py", "-k", "accept_compact")
    assert run.returncode == 0, run.stdout
    assert "kdtree: checking kernels/accept_compact.kdtr" in run.stdout.splitlines(), run.stdout


class Metafunc:
    """What the plugin's pytest_generate_tests reads of pytest's, and the parametrization it asks for."""

    fixturenames = ["kdtree_case"]

    def __init__(self, **options: str | None) -> None:
        self.config = SimpleNamespace(stash=pytest.Stash(), getoption=options.__getitem__)
        self.ids: list[str] = []

    def parametrize(self, name, params, indirect):
        self.ids = [p.id for p in params]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnknownMarkWarning")   # xdist_group: the plugin may be unloaded
def test_the_dtype_option_reaches_the_plan_and_a_bad_one_is_named(golden):
    bf16 = Metafunc(kdtree_fixtures=str(golden / "tiny.kdtr"), kdtree_dtype="bfloat16")
    pytest_generate_tests(bf16)
    assert bf16.ids == [c.id for c in plan(golden / "tiny.kdtr", "bfloat16")] and "tiny.kdtr::routing" in bf16.ids
    bad = Metafunc(kdtree_fixtures=None, kdtree_dtype="float16")
    with pytest.raises(pytest.fail.Exception, match="^kdtree: --kdtree-dtype must be one of float32, bfloat16, "
                                                    "got 'float16'$"):
        pytest_generate_tests(bad)


def test_assert_passes_fails_skips_or_passes_as_the_row_says():
    fail = Check("tiny.kdtr", "verify logits", Status.FAIL, 3e-3, 3e-4, detail="first wrong node 3 (trace t0 round 1)")
    with pytest.raises(pytest.fail.Exception, match=re.escape(fail.text())):
        assert_passes(fail)
    near = Check("tiny.kdtr", "AR tokens", Status.NEAR_TIE, margin=1e-6, tolerance=1e-4, detail="at 3")
    with pytest.raises(pytest.skip.Exception, match=re.escape(near.text())):
        assert_passes(near)
    with pytest.raises(pytest.skip.Exception, match=r"^tiny.kdtr::tree compile: skipped \(not implemented"):
        assert_passes(Check("tiny.kdtr", "tree compile", Status.SKIPPED, detail="skipped (not implemented by adapter)"))
    for status in (Status.EXACT, Status.WITHIN):
        assert_passes(Check("tiny.kdtr", "x", status, 1e-6, 1e-5))


def test_the_plugin_leaves_the_projects_own_suite_alone():
    """The project's suite with the plugin loaded (as an install autoloads it): importlib mode,
    no cache provider, and no test of its own parametrized (a file of the suite's; its example
    outputs, which rerun the CLIs, left out)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/test_docs.py", "-k", "not example_output", "-q",
                          "-p", "no:cacheprovider", "-p", "engine.pytest_plugin", "-W", "error::pytest.PytestWarning"],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "kdtree_case" not in run.stdout and re.match(r"\d+ passed", summary(run)), summary(run)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnknownMarkWarning")
def test_the_dtype_option_reaches_the_run(golden):
    """--kdtree-dtype bfloat16 reaches the run as well as the plan: the adapter is told the dtype
    and the rows are judged in its regime (a verify-attention case: bf16-rounded inputs, the
    bf16 tolerance)."""
    from engine.pytest_plugin import BUILT_IN, kdtree_validation

    fixture = golden / "kernels" / "verify_attention.kdtr"
    options = {"kdtree_fixtures": str(fixture), "kdtree_require": "none", "kdtree_dtype": "bfloat16"}
    config = SimpleNamespace(getoption=options.__getitem__, pluginmanager=SimpleNamespace(get_plugin=lambda name: None))
    session = kdtree_validation.__wrapped__(config, BUILT_IN)
    validation = next(session)
    try:
        (case,) = [c for c in plan(fixture, "bfloat16") if c.name == "verify attention (o_lat)"]
        row = validation.check(case)
        assert row.regime == "bf16: the kernel case's tolerances_bf16 (inputs rounded to bf16)", row
        assert row.status is not Status.FAIL, row.text()
        assert str(validation.adapter.dtype) == "torch.bfloat16"
    finally:
        session.close()
