"""Adapters that return None, exit, die, hang or misbehave at the door (hostile_adapters.py): each
is that adapter's failure, named in one line or one FAIL row, never a false pass, a traceback,
kdtree blamed, or a report left unwritten. The in-process checks are what the pytest plugin
runs; the CLI runs the adapter in a child process it watches (engine/validate/supervised.py)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cli_run import run_main
from engine.validate import GOLDEN_DIR, Status, ValidateError, Validation, load_impl, validate
from terminal import in_terminal

HOSTILE = Path(__file__).with_name("hostile_adapters.py")


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
