"""Adapters that return None, exit, die, hang or misbehave at the door (hostile_adapters.py): each
is that adapter's failure, named in one line or one FAIL row, never a false pass, a traceback,
kdtree blamed, or a report left unwritten. The in-process checks are what the pytest plugin
runs; the CLI runs the adapter in a child process it watches (engine/validate/door/supervise.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import engine.validate.door.supervise
from cli_run import run_main
from engine.validate import GOLDEN_DIR, Status, ValidateError, Validation, load_impl, validate
from terminal import in_terminal

HOSTILE = Path(__file__).with_name("hostile_adapters.py")


def verdict(err: str) -> str:
    """The terminal report's verdict line (the FAIL rows are listed again below it)."""
    return next(line for line in reversed(err.splitlines()) if line.startswith(("PASSED: ", "FAILED: ")))


def spec(name: str) -> str:
    return f"{HOSTILE}:{name}"


def fixtures(tmp_path: Path, *names: str) -> Path:
    """A fixture directory of links to committed kernel fixtures (skip when absent)."""
    for name in names:
        if not (GOLDEN_DIR / "kernels" / name).exists():
            pytest.skip(f"golden fixture kernels/{name} is absent")
        (tmp_path / "fx" / "kernels").mkdir(parents=True, exist_ok=True)
        (tmp_path / "fx" / "kernels" / name).symlink_to(GOLDEN_DIR / "kernels" / name)
    return tmp_path / "fx"


def failures(report: dict) -> dict[str, str]:
    return {c["name"]: c["detail"] for c in report["checks"] if c["status"] == "FAIL"}


FOUR_WAYS = {"top-k log-probs": "topk_logprobs() raised SystemExit: 0 (case ",
             "tree build": "build_tree() raised GeneratorExit (case ",
             "tree compile": "compile_tree() raised Stop: engine stopped (case ",
             "accept": "accept() raised Unprintable (its str() raised RuntimeError: __str__ raised) (case "}


# ---- in process: the checks as the plugin runs them ----

def test_a_factory_must_return_an_adapter():
    with pytest.raises(ValueError, match=r"^--impl '.*:forgets_to_return': forgets_to_return\(\) returned None, "
                                         r"expected an adapter"):
        load_impl(spec("forgets_to_return"))
    with pytest.raises(ValueError, match=r"^--impl '.*:exits': exits\(\) raised SystemExit: 0$"):
        load_impl(spec("exits"))


def test_exits_and_base_exceptions_fail_the_method_that_raised_them(tmp_path):
    report = validate(load_impl(spec("ExitsFourWays")), fixtures(tmp_path, "tree_build.kdtr", "accept_compact.kdtr"),
                      require="none")
    found = {c.name: c.detail for c in report.checks if c.status is Status.FAIL}
    assert found.keys() == FOUR_WAYS.keys(), found
    for name, start in FOUR_WAYS.items():
        assert found[name].startswith(start), found[name]
    assert next(c for c in report.checks if c.name == "KV compaction").status is Status.EXACT


@pytest.mark.parametrize("name, message", [
    ("RaisingName", r"^adapter RaisingName: reading its `name` raised RuntimeError: no name today$"),
    ("RaisingGetattr", r"^adapter 'built-in engine stages': reading its `(\w+)` raised RuntimeError: "
                       r"no \1 here$"),
    ("NumberForBackends", r"^adapter 'built-in engine stages': `backends` must be a mapping of names to what ran "
                          r"them, got int$"),
])
def test_an_attribute_that_raises_is_the_adapters_error(name, message):
    with pytest.raises(ValidateError, match=message):
        Validation(load_impl(spec(name)), GOLDEN_DIR / "kernels" / "accept_compact.kdtr")


@pytest.mark.parametrize("name", ["ReusesLogits", "ReusesEveryOutput"])      # protocol v1, v2
def test_a_correct_engine_that_reuses_its_output_buffers_passes(name):
    if not (GOLDEN_DIR / "tiny.kdtr").exists():
        pytest.skip("golden fixture tiny.kdtr is absent")
    report = validate(load_impl(spec(name)), GOLDEN_DIR / "tiny.kdtr", require="model")
    assert not report.failed, [c.text() for c in report.checks if c.status is Status.FAIL]


# ---- the CLI: the adapter in a watched child process ----

@pytest.mark.parametrize("start", ["fork", "spawn"])           # spawn: where CUDA is initialized already
def test_the_cli_fails_an_adapter_that_exits_and_the_json_goes_to_stdout(tmp_path, capsys, monkeypatch, start):
    monkeypatch.setattr(engine.validate.door.supervise, "_start_method", lambda: start)
    junit = tmp_path / "r.xml"
    code, out, err = run_main(["validate", "--fixtures", str(fixtures(tmp_path, "tree_build.kdtr", "accept_compact.kdtr")),
                               "--impl", spec("ExitsFourWays"), "--require", "none", "--json", "-",
                               "--junit-xml", str(junit)], capsys)
    assert code == 1, err
    report = json.loads(out)                                  # stdout holds the JSON alone
    assert report["passed"] is False and failures(report).keys() == FOUR_WAYS.keys()
    assert "FAILED" in verdict(err) and "Traceback" not in err               # the terminal report: stderr
    assert ET.parse(junit).getroot().get("failures") == "4"


def test_an_adapter_that_ends_the_process_fails_the_row_in_flight(tmp_path, capsys):
    if not (GOLDEN_DIR / "tiny.kdtr").exists():
        pytest.skip("golden fixture tiny.kdtr is absent")
    report_path = tmp_path / "r.json"
    code, out, err = run_main(["validate", "--fixtures", str(GOLDEN_DIR / "tiny.kdtr"), "--impl", spec("DiesInForward"),
                               "--json", str(report_path), "--junit-xml", "-"], capsys)
    assert code == 1, err
    report = json.loads(report_path.read_text())
    assert failures(report) == {"prefill logits": "forward() ended the process with exit status 0 (prompt p0); "
                                                  "nothing after it ran"}
    not_run = [c for c in report["checks"] if c["detail"].startswith("not run: ")]
    assert not_run and all(c["status"] == "skipped" for c in not_run)
    assert ET.fromstring(out).get("failures") == "1"          # the JUnit XML on stdout
    assert "FAILED" in verdict(err)


def test_a_process_the_adapter_leaves_behind_does_not_hold_the_run(tmp_path, capsys, monkeypatch):
    if not (GOLDEN_DIR / "tiny.kdtr").exists():
        pytest.skip("golden fixture tiny.kdtr is absent")
    monkeypatch.setenv("HOSTILE_LEFT", str(tmp_path))
    try:
        code, out, err = run_main(["validate", "--fixtures", str(GOLDEN_DIR / "tiny.kdtr"), "--impl",
                                   spec("DiesLeavingAProcess")], capsys)
        assert not (tmp_path / "woke").exists(), "the run waited for the process the adapter left"
    finally:
        os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    assert code == 1 and "forward() ended the process with exit status 0 (prompt p0)" in out, out + err


def test_a_call_that_never_returns_fails_after_the_timeout_in_a_terminal(tmp_path):
    report_path = tmp_path / "r.json"
    result = in_terminal(["kdtree", "validate", "--fixtures", str(fixtures(tmp_path, "tree_build.kdtr")), "--impl",
                          spec("HangsInTopk"), "--require", "none", "--timeout", "1", "--json", str(report_path)],
                         columns=80)
    assert result.returncode == 1, result.output
    assert "Traceback" not in result.output and result.widest <= 80, result.output
    assert re.search(r"FAILED: \d+ checks", result.output), result.output
    found = failures(json.loads(report_path.read_text()))
    assert found == {"top-k log-probs": found["top-k log-probs"]}
    assert re.fullmatch(r"topk_logprobs\(\) did not return within 1 s \(case \w+\); nothing after it ran",
                        found["top-k log-probs"]), found


def test_a_file_adapter_imports_its_neighbours(tmp_path, monkeypatch):
    """--impl path/to/file.py:factory: the file's folder is on the import path, as for
    `python path/to/file.py`, while it is imported and after (an import inside a method)."""
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    (tmp_path / "my_adapter_helpers.py").write_text("NAME = 'from a neighbour'\n")
    (tmp_path / "my_adapter.py").write_text(
        "import my_adapter_helpers\n"
        "class Adapter:\n"
        "    name = my_adapter_helpers.NAME\n"
        "    def later(self):\n"
        "        import my_adapter_helpers as again\n"
        "        return again.NAME\n"
        "def make():\n"
        "    return Adapter()\n")
    adapter = load_impl(f"{tmp_path / 'my_adapter.py'}:make")
    assert adapter.name == "from a neighbour" and adapter.later() == "from a neighbour"


@pytest.mark.parametrize("given", ["", "  "])
def test_an_empty_impl_is_an_error_never_the_built_in_engine(given):
    """`--kdtree-impl "$IMPL"` with IMPL unset: the plugin's adapter fixture fails naming it (the CLI's
    --impl: tests/engine/test_cli.py)."""
    from types import SimpleNamespace

    from engine.pytest_plugin import kdtree_adapter

    config = SimpleNamespace(getoption={"kdtree_impl": given}.__getitem__)
    with pytest.raises(pytest.fail.Exception, match=rf"^kdtree: --kdtree-impl '{given}' is empty: name the adapter's "
                                                    r"factory"):
        kdtree_adapter.__wrapped__(config)
