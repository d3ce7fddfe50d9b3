"""The report's other forms, from a run that fails for a planted positions bug: JUnit XML
(`--junit-xml`; checked against the JUnit schema tests/engine/data/junit.xsd with
xmlschema) and the HTML page (`--html`; its structure here, and loaded in headless
Chromium, which must show it offline without a console error); and what the rows carry for
them (the first wrong node of a failing round, acceptance lengths per trace)."""

from __future__ import annotations

import html.parser
import io
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

import headless
import kdtr_format
from engine.adapter import TorchAdapter
from cli_run import run_main
from engine.validate import Check, Report, Status, ValidateError, Validation, plan
from engine.cli.validate_cmd import render
from engine.validate.door.protocol_v2 import PerRequest
from engine.validate.reports.junit import to_junit, write_junit

pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[test]' from a checkout): the HTML "
                    "report draws its plots with it")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from engine.validate.reports.html import _stage_figure, _tree_figure, acceptance_lengths, to_html, write_html  # noqa: E402

SCHEMA = Path(__file__).parent / "data" / "junit.xsd"
BROKEN = Path(__file__).resolve().parents[2] / "docs" / "examples" / "broken_adapter.py"


class ShiftedTreePositions(PerRequest):
    """The built-in engine through protocol v1, with tree positions one too far from node 3 on
    (a planted bug)."""

    name = "shifted tree positions"
    capabilities = ("model", "tree", "accept", "sample_accept")

    def __init__(self) -> None:
        super().__init__(TorchAdapter())

    def forward(self, tokens, positions, visibility, start):
        positions = np.array(positions)
        if start > 0 and len(tokens) > 3:
            positions[3:] += 1
        return super().forward(tokens, positions, visibility, start)


@pytest.fixture(scope="module")
def tiny(golden) -> Path:
    return golden / "tiny.kdtr"


@pytest.fixture(scope="module")
def failing_run(tiny) -> Validation:
    """The planted bug's run over tiny.kdtr, its report made."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        validation = Validation(ShiftedTreePositions(), tiny)
        validation.report().timings = {"total_seconds": 1.5}
    finally:
        torch.set_num_threads(threads)
    return validation


@pytest.fixture(scope="module")
def failing(failing_run) -> Report:
    return failing_run.report()


@pytest.fixture(scope="module")
def failing_page(failing) -> str:
    return to_html(failing)


def row(report: Report, name: str) -> Check:
    (found,) = [c for c in report.checks if c.name == name]
    return found


def a_row_of_every_status() -> Report:
    """Rows of every status, one detail holding characters XML cannot (an ANSI escape), one timed run."""
    checks = [Check("a.kdtr", "exact row", Status.EXACT),
              Check("a.kdtr", "within row", Status.WITHIN, 1e-6, 1e-5),
              Check("a.kdtr", "near row", Status.NEAR_TIE, margin=1e-6, tolerance=1e-4, detail="at 3: got 4, expected 5"),
              Check("a.kdtr", "skipped row", Status.SKIPPED, detail="skipped (not implemented by adapter)"),
              Check("b.kdtr", "failing row", Status.FAIL, 3e-3, 1e-5, detail="forward() raised \x1b[31mboom\x00"),
              Check("b.kdtr", "timed run", Status.EXACT,
                    tables={"stage_seconds": {"device": "cpu", "draft": 0.1, "verify": 0.3},
                            "acceptance": {"accepted_ranks": [[0, 1], [], [0]]}})]
    return Report("every status", "cpu", "somewhere", checks=checks, section_seconds={"a.kdtr": 0.5})


def hostile_names() -> Report:
    """A failing report whose names hold what matplotlib's mathtext (`$\\foo$`), a UTF-8 encoder (a
    lone surrogate, a non-UTF-8 file name's byte) and a terminal (an escape sequence) would act on."""
    node = {"trace": "$\\foo$", "round": 0, "node": 2, "depth": 1, "position": 5, "parents": [-1, 0, 0],
            "accepted": [0, 1]}
    checks = [Check("$\\foo$.kdtr", "$\\foo$", Status.FAIL, 2e-3, 1e-5, detail="forward() raised \udc80 \x1b[2J",
                    tables={"first_wrong_node": node, "acceptance_lengths": {"$\\bar$": [1, 2]}}),
              Check("\udcff.kdtr", "timed $\\x$", Status.EXACT,
                    tables={"stage_seconds": {"device": "$\\cpu$", "draft": 0.1, "verify": 0.2}})]
    return Report("$\\foo$ \x1b]0;pwned\x07", "cpu", "\udcff", checks=checks, backends={"stages": "\u202e"})


# ---- what the reports record of the run ----

REPO = Path(__file__).resolve().parents[2]


def commit_of_a_copy(root: Path, inside: str) -> str:
    """What `_commit()` says for a copy of the package (no .git of its own) at root/inside."""
    for package in ("engine", "kdtr_format"):
        shutil.copytree(REPO / package, root / inside / package, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["PYTHONPATH"] = str(root / inside)
    run = subprocess.run([sys.executable, "-c", "from engine.cli.validate_cmd import _commit; print(_commit())"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def a_foreign_repository(root: Path) -> str:
    git = ["git", "-c", "user.name=x", "-c", "user.email=x@x", "-C", str(root)]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "theirs.txt").write_text("not kdtree\n")
    subprocess.run([*git, "add", "theirs.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "theirs"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("inside", [".", "vendor/kdtree"])
def test_a_copy_inside_another_repository_records_no_commit(tmp_path, inside):
    theirs = a_foreign_repository(tmp_path)
    assert commit_of_a_copy(tmp_path, inside) == "None", f"the foreign repository's commit is {theirs}"


def test_a_copy_outside_any_repository_records_no_commit(tmp_path):
    assert commit_of_a_copy(tmp_path, ".") == "None"


def test_the_report_names_the_adapter_class_and_the_impl_spec(golden, tmp_path, capsys):
    fixture = golden / "kernels" / "tree_build.kdtr"
    spec = f"{BROKEN}:BrokenTieAdapter"
    json_path, xml_path, html_path = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.html"
    code, out, _ = run_main(["validate", "--fixtures", str(fixture), "--impl", spec, "--require", "topk,tree",
                             "--json", str(json_path), "--junit-xml", str(xml_path), "--html", str(html_path)], capsys)
    assert code == 1
    adapter = "kdtree_impl_broken_adapter.BrokenTieAdapter"
    assert f"adapter: {adapter} (--impl {spec})" in " ".join(out.split())
    report = json.loads(json_path.read_text())
    assert (report["adapter"], report["impl"]) == (adapter, spec)
    properties = {p.get("name"): p.get("value") for p in ET.parse(xml_path).getroot().iter("property")}
    assert (properties["adapter"], properties["impl"]) == (adapter, spec)
    assert f"{adapter} (--impl {spec})" in " ".join(Outline(html_path.read_text()).text)


def test_the_built_in_engine_is_named_so(golden, tmp_path, capsys):
    json_path = tmp_path / "r.json"
    code, out, _ = run_main(["validate", "--fixtures", str(golden / "kernels" / "tree_build.kdtr"),
                             "--require", "topk,tree,compile", "--json", str(json_path)], capsys)
    assert code == 0 and "adapter: engine.adapter.TorchAdapter (built-in)" in out
    report = json.loads(json_path.read_text())
    assert (report["adapter"], report["impl"]) == ("engine.adapter.TorchAdapter", None)


# ---- the rows: case by case as in the report, and what they carry ----

def test_the_plan_names_the_rows_and_each_case_is_its_report_row(tiny, failing_run, failing):
    cases = plan(tiny)
    rows = [(c.section, c.name, c.needs) for c in failing.checks]
    assert rows == [(c.section, c.name, c.needs) for c in cases
                    if c.section == "tiny.kdtr" and not c.builtin_only and not c.v2_only]     # a v1 adapter
    by_id = {f"{c.section}::{c.name}": c for c in failing.checks}
    for case in cases:
        got = failing_run.check(case)
        if case.builtin_only:
            assert got.status is Status.SKIPPED and "built-in engine" in got.detail
        elif case.v2_only:
            assert got.status is Status.SKIPPED and "protocol v2" in got.detail
        elif case.section == "validate":
            required = case.needs and case.needs[0] in ("model", "tree", "accept", "sample_accept")
            assert got.status is (Status.EXACT if required or not case.needs else Status.SKIPPED), got
        else:
            assert got == by_id[case.id]


def test_a_v2_adapters_plan_holds_its_batched_rows(tiny):
    cases = [c for c in plan(tiny) if c.section == "tiny.kdtr" and not c.builtin_only]
    validation = Validation(TorchAdapter(), tiny)
    report = validation.report()
    assert [(c.section, c.name, c.needs) for c in report.checks if c.section == "tiny.kdtr"] == \
        [(c.section, c.name, c.needs) for c in cases]
    assert [validation.check(c) for c in cases] == [c for c in report.checks if c.section == "tiny.kdtr"]
    assert any(c.v2_only for c in cases)


class AcceptOnly:
    name = "accept only"

    def __init__(self) -> None:
        self.engine = PerRequest(TorchAdapter())

    def accept(self, parents, tokens, choices):
        return self.engine.accept(parents, tokens, choices)


def test_the_validate_cases_apply_the_requirements(golden, tmp_path):
    fixture = golden / "kernels" / "accept_compact.kdtr"
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "accept_compact.kdtr").symlink_to(fixture)
    cases = {c.name: c for c in plan(tmp_path) if c.section == "validate"}
    validation = Validation(AcceptOnly(), tmp_path, require="accept,compact,model")
    outcome = {name: (validation.check(case).status, validation.check(case).detail) for name, case in cases.items()}
    assert outcome["capability accept"] == (Status.EXACT, "required; 1 rows exercised it")
    assert outcome["capability compact"] == (Status.FAIL, "required, but the adapter has no compact()")
    assert outcome["capability model"] == (Status.FAIL, "required, but the adapter has no load_weights(), reset(), "
                                                        "forward()")
    assert outcome["capability tree"] == (Status.SKIPPED, "capability tree is not required")
    assert outcome["any check ran"][0] is Status.EXACT
    report_rows = {(c.section, c.name): c.status for c in validation.report().checks}
    assert report_rows[("kernels/accept_compact.kdtr", "KV compaction")] is Status.FAIL   # the same rule, as rows
    assert report_rows[("validate", "capability model")] is Status.FAIL
    nothing = Validation(AcceptOnly(), tmp_path / "kernels" / "accept_compact.kdtr", require="none")
    assert nothing.check(cases["any check ran"]).status is Status.EXACT
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tree_build.kdtr").symlink_to(golden / "kernels" / "tree_build.kdtr")
    skipped_all = Validation(AcceptOnly(), tmp_path / "other", require="none")
    ran = skipped_all.check(cases["any check ran"])
    assert ran.status is Status.FAIL and ran.detail == "no check ran: every row was skipped"


class DeclaresAcceptAndTree(AcceptOnly):
    capabilities = ("accept", "tree")

    def build_tree(self, topk_lp, topk_id, budget, block_size):
        return self.engine.build_tree(topk_lp, topk_id, budget, block_size)

    def set_dtype(self, dtype: str) -> None:
        self.dtype = dtype


def test_a_declared_capability_no_fixture_checks_is_the_same_skipped_row_per_case(golden, tmp_path):
    fixture = golden / "kernels" / "accept_compact.kdtr"
    fixture_dir = tmp_path / "fx"
    (fixture_dir / "kernels").mkdir(parents=True)
    (fixture_dir / "kernels" / "accept_compact.kdtr").symlink_to(fixture)
    validation = Validation(DeclaresAcceptAndTree(), fixture_dir)
    (tree,) = [c for c in plan(fixture_dir) if c.id == "validate::capability tree"]
    got = validation.check(tree)
    assert got.status is Status.SKIPPED and got.detail == (
        f"declared, but no fixture in {fixture_dir} has checks for it (--require tree makes this a FAIL)")
    assert [c for c in validation.report().checks if c.section == "validate"] == [got]
    named = Validation(DeclaresAcceptAndTree(), fixture_dir, require="tree").check(tree)
    assert named.status is Status.FAIL and named.detail == f"required, but no check of {fixture_dir} exercised it"


def test_the_bf16_plan_has_the_routing_row_skipped_where_no_model_ran(tiny):
    cases = [c for c in plan(tiny, "bfloat16") if c.section == "tiny.kdtr" and not c.builtin_only]
    assert "routing" in [c.name for c in cases] and "routing" not in [c.name for c in plan(tiny)]
    validation = Validation(DeclaresAcceptAndTree(), tiny, dtype="bfloat16")
    report = validation.report()
    ran = [c for c in cases if c.name != "routing" and not c.v2_only]    # a v1 adapter: no batched rows
    assert [c.name for c in report.checks if c.section == "tiny.kdtr"] == [c.name for c in ran]
    by_name = {c.name: c for c in report.checks}
    for case in cases:
        got = validation.check(case)
        if case.v2_only:
            assert got.status is Status.SKIPPED and "protocol v2" in got.detail, got
        else:
            assert got == (by_name[case.name] if case.name != "routing" else
                           Check("tiny.kdtr", "routing", Status.SKIPPED, detail=case.absent))
    with pytest.raises(ValidateError, match="--dtype must be one of float32, bfloat16, got 'float16'"):
        plan(tiny, "float16")


def test_a_fixture_whose_checks_stop_fails_each_of_its_cases(tmp_path):
    tensors = {f"cases/c/{name}": np.zeros(1, np.int64) for name in ("parents", "tokens", "depths", "topk_id")}
    tensors.update({"cases/c/scores": np.zeros(1), "cases/c/topk_lp": np.zeros((1, 1), np.float32)})
    kdtr_format.write(tmp_path / "tree_build.kdtr", tensors,       # its case has no budget
                      metadata={"kind": "tree_build", "cases": [{"name": "c", "start": 0}]})
    kdtr_format.write(tmp_path / "odd.kdtr", {"x": np.zeros(1)}, metadata={"kind": "mystery"})
    cases = [c for c in plan(tmp_path) if c.section.endswith(".kdtr")]
    rows = ["top-k log-probs", "tree build", "tree compile"]
    assert [c.id for c in cases] == ["odd.kdtr::fixture", *(f"tree_build.kdtr::{name}" for name in rows),
                                     *(f"tree_build.kdtr::batched {name}" for name in rows)]
    validation = Validation(TorchAdapter(), tmp_path, require="none")   # protocol v2: batched rows too
    odd, *stopped = [validation.check(c) for c in cases]
    assert odd.status is Status.FAIL and odd.detail == "unknown fixture kind 'mystery'"
    assert [c.name for c in stopped] == [*rows, *(f"batched {name}" for name in rows)]
    assert all(c.status is Status.FAIL and c.detail.startswith("checking stopped: KeyError") for c in stopped)
    assert [c.name for c in validation.report().checks] == ["fixture", "fixture"]     # the CLI's rows, unchanged
    declared = Validation(DeclaresAcceptAndTree(), tmp_path)        # a stopped fixture's rows check nothing
    rows = [c for c in declared.report().checks if c.section == "validate"]
    assert [(c.name, c.status) for c in rows] == [("capability accept", Status.SKIPPED),
                                                  ("capability tree", Status.SKIPPED)]
    per_case = [declared.check(c) for c in plan(tmp_path) if c.name in ("capability accept", "capability tree")]
    assert sorted(per_case, key=lambda c: c.name) == rows


def test_a_failing_round_names_its_first_wrong_node_as_a_table(tiny, failing):
    for name in ("verify logits", "target choices", "sampled choices"):
        check = row(failing, name)
        assert check.status is Status.FAIL
        node = check.tables["first_wrong_node"]
        words = f"node {node['node']} (depth {node['depth']}, position {node['position']})"
        assert words in check.detail and f"(trace {node['trace']} round {node['round']}" in check.detail
        with kdtr_format.open(tiny) as reader:
            prefix = f"traces/{node['trace']}/rounds/{node['round']}"
            assert node["parents"] == np.asarray(reader[f"{prefix}/parents"]).tolist()
            assert node["accepted"] == np.asarray(reader[f"{prefix}/accepted"]).tolist()
            assert node["depth"] == int(reader[f"{prefix}/depths"][node["node"]])
    assert "first_wrong_node" not in row(failing, "tree build").tables


def test_token_rows_carry_each_traces_acceptance_lengths(tiny, failing):
    with kdtr_format.open(tiny) as reader:
        traces = reader.metadata["traces"]
        recorded = {t["name"]: np.asarray(reader[f"traces/{t['name']}/acceptance_lengths"]).tolist() for t in traces}
        greedy = {t["name"] for t in traces if t["ddtree"].get("temperature", 0.0) == 0.0}
    assert row(failing, "DDTree tokens").tables["acceptance_lengths"] == {n: recorded[n] for n in sorted(greedy)}
    assert row(failing, "sampled DDTree tokens").tables["acceptance_lengths"] == \
        {n: v for n, v in recorded.items() if n not in greedy}
    assert acceptance_lengths(a_row_of_every_status().checks[-1]) == {"timed run": [3, 1, 2]}


# ---- JUnit XML ----

def schema_errors(path: Path) -> list[str]:
    xmlschema = pytest.importorskip("xmlschema", reason="the JUnit schema check needs xmlschema (the test extra)")
    return [str(e) for e in xmlschema.XMLSchema(SCHEMA).iter_errors(str(path))]


@pytest.mark.parametrize("which", ["failing run", "every status"])
def test_junit_xml_has_one_testcase_per_row_and_passes_the_schema(failing, tmp_path, which):
    report = failing if which == "failing run" else a_row_of_every_status()
    path = tmp_path / "report.xml"
    write_junit(report, path)
    assert schema_errors(path) == []
    root = ET.parse(path).getroot()
    cases = root.findall("testsuite/testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [(r.section, r.name) for r in report.checks]
    for case, check in zip(cases, report.checks):
        outcome = list(case)
        if check.status is Status.FAIL:
            (failure,) = outcome
            assert failure.tag == "failure" and "FAIL" in failure.get("message")
            assert check.name in failure.get("message") and failure.text and failure.text in check.detail.replace(
                "\x1b", "\\x1b").replace("\x00", "\\x00")
        elif check.status in (Status.SKIPPED, Status.NEAR_TIE):
            (skipped,) = outcome
            assert skipped.tag == "skipped" and skipped.get("message") == check.text()
        else:
            assert outcome == []
    assert root.get("failures") == str(sum(c.status is Status.FAIL for c in report.checks))
    assert root.get("tests") == str(len(report.checks))
    for element in (root, *root.findall("testsuite")):       # each count as its testcases' outcomes
        outcomes = [[e.tag for e in case] for case in element.iter("testcase")]
        assert {k: element.get(k) for k in ("tests", "failures", "errors", "skipped")} == {
            "tests": str(len(outcomes)), "failures": str(outcomes.count(["failure"])), "errors": "0",
            "skipped": str(outcomes.count(["skipped"]))}


def test_junit_xml_counts_a_near_tie_row_as_skipped():
    """A near-tie row is a <skipped> testcase and counts in skipped=, beside a skipped row."""
    root = to_junit(a_row_of_every_status())
    suite = root.find("testsuite[@name='a.kdtr']")
    assert [c.get("name") for c in suite.iter("testcase") if c.find("skipped") is not None] == ["near row",
                                                                                               "skipped row"]
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("4", "0", "2")
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("6", "1", "2")


def test_junit_xml_escapes_what_xml_cannot_hold(tmp_path):
    path = tmp_path / "report.xml"
    write_junit(a_row_of_every_status(), path)
    text = path.read_text()
    assert "\x1b" not in text and "\\x1b[31mboom\\x00" in text


def test_junit_xml_of_a_run_in_which_nothing_ran_fails(tmp_path):
    report = Report("nothing", "cpu", "x", checks=[Check("a.kdtr", "s", Status.SKIPPED, detail="skipped")])
    assert report.failed
    cases = to_junit(report).findall("testsuite/testcase")
    assert [(c.get("classname"), c.get("name"), [e.tag for e in c]) for c in cases] == [
        ("a.kdtr", "s", ["skipped"]), ("validate", "any check ran", ["failure"])]


# ---- the CLI writes both ----

def test_validate_writes_junit_xml_and_html(golden, tmp_path, capsys):
    fixture = golden / "kernels" / "tree_build.kdtr"
    xml_path, html_path = tmp_path / "r.xml", tmp_path / "r.html"
    code, out, err = run_main(["validate", "--fixtures", str(fixture), "--impl", f"{BROKEN}:BrokenTieAdapter",
                               "--require", "topk,tree", "--junit-xml", str(xml_path), "--html", str(html_path)], capsys)
    assert code == 1 and "FAILED" in out
    assert f"wrote {xml_path}" in err and f"wrote {html_path}" in err
    assert schema_errors(xml_path) == []
    (failure,) = ET.parse(xml_path).getroot().iter("failure")
    assert "tree build" in failure.get("message") and "tied_logits" in failure.text
    page = html_path.read_text()
    assert "FAILED" in page and "tied_logits" in page and page.startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r.xml"]       # no temporary files left


def test_html_without_matplotlib_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else
                        find_spec(name, *a))
    code, _, err = run_main(["validate", "--html", str(tmp_path / "r.html")], capsys)
    assert code == 2 and err.strip() == ("kdtree: error: --html needs matplotlib: pip install matplotlib (in a "
                                         "checkout: pip install -e '.[plot]')")
    assert list(tmp_path.iterdir()) == []


# ---- the terminal report ----

def test_the_terminal_report_escapes_what_names_hold():
    buffer = io.StringIO()
    render(hostile_names(), Console(file=buffer, force_terminal=True, width=80))
    text = buffer.getvalue()
    for raw in ("\x1b[2J", "\x1b]", "\x07", "\u202e", "\udc80", "\udcff"):
        assert raw not in text, f"{raw!r} reached the terminal:\n{text!r}"
    for shown in (repr("$\\foo$ \x1b]0;pwned\x07"), repr("\udcff.kdtr"), repr("forward() raised \udc80 \x1b[2J")):
        assert shown in text, f"{shown} is not shown:\n{text}"


def test_the_terminal_report_wraps_a_long_row_under_itself():
    long = "corpus budget_beyond_possible: budget larger than the number of possible nodes"
    report = Report("x", "cpu", "somewhere", adapter="m.A",
                    checks=[Check("a.kdtr", long, Status.EXACT, detail="w " * 60, regime="exact"),
                            Check("a.kdtr", "short", Status.SKIPPED)])
    buffer = io.StringIO()
    render(report, Console(file=buffer, force_terminal=True, color_system=None, width=80))
    lines = buffer.getvalue().splitlines()
    rows = lines[lines.index("a.kdtr") + 1 : lines.index("fixtures: somewhere")]
    assert all(len(line) <= 80 and line.startswith("  ") for line in rows), "\n".join(rows)
    assert " ".join(" ".join(rows).split()) == f"exact {long} [exact] {'w ' * 59}w skipped short"


# ---- the HTML page ----

class Outline(html.parser.HTMLParser):
    """What a page is made of: its tags in order, images (alt, src), every external reference."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags, self.images, self.external, self.text = [], [], [], []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs.get("id"), attrs.get("class")))
        if tag == "img":
            self.images.append((attrs["alt"], attrs["src"]))
        for key in ("src", "href"):
            if key in attrs and not attrs[key].startswith(("data:image/png;base64,", "#")):
                self.external.append(attrs[key])

    def handle_data(self, data):
        self.text.append(data)


def test_html_page_summary_first_then_every_row_and_its_plots(failing, failing_page):
    outline = Outline(failing_page)
    assert not outline.external and not any(tag in ("script", "link", "iframe") for tag, _, _ in outline.tags)
    body = [t for t in outline.tags if t[0] not in ("html", "head", "meta", "title", "style", "body")]
    assert body[:2] == [("h1", None, None), ("section", "summary", "summary FAILED")]
    text = " ".join(" ".join(outline.text).split())
    assert failing.summary() in text
    for check in failing.checks:                                            # every row in its section's table
        assert " ".join(f"{check.status.value} {check.name} {check.numbers()} {check.detail}".split()) in text
        if check.status is Status.FAIL:                                     # and the FAIL rows in the summary
            assert " ".join(check.text().split()) in text
    rows = [t for t in outline.tags if t[0] == "tr" and t[2]]
    assert [t[2] for t in rows] == [c.status.value for c in failing.checks]
    alts = [alt for alt, _ in outline.images]
    assert alts[0] == "error against tolerance, every row of tiny.kdtr"
    for name in ("verify logits", "target choices", "sampled choices"):
        node = row(failing, name).tables["first_wrong_node"]
        assert f"the tree of trace {node['trace']} round {node['round']}, node {node['node']} marked" in alts
    assert "acceptance lengths, DDTree tokens" in alts and "acceptance lengths, sampled DDTree tokens" in alts
    every = Outline(to_html(a_row_of_every_status()))
    assert "seconds per stage of the timed runs" in [alt for alt, _ in every.images]
    assert "a.kdtr" in " ".join(every.text) and "0.50" in " ".join(every.text)        # time per section


def test_html_page_shows_names_that_matplotlib_and_utf8_cannot_take(tmp_path):
    path = tmp_path / "r.html"
    write_html(hostile_names(), path)
    text = " ".join(Outline(path.read_text(encoding="utf-8")).text)
    for shown in ("$\\foo$.kdtr", repr("\udcff.kdtr"), repr("forward() raised \udc80 \x1b[2J")):
        assert shown in text, shown
    assert "\x1b" not in text and "\u202e" not in text


def drawn_boxes(fig):
    """The figure drawn: its box and the renderer to measure artists with."""
    fig.canvas = FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    return fig.bbox, renderer


@pytest.mark.parametrize("node", [2, 4])                 # the leftmost leaf, the rightmost
def test_the_tree_plot_shows_its_label_whole(node):
    fig = _tree_figure({"trace": "t0", "round": 0, "node": node, "depth": 1, "position": 123456,
                        "parents": [-1, 0, 0, 0, 0], "accepted": [0, 1]})
    box, renderer = drawn_boxes(fig)
    (label,) = [t for t in fig.axes[0].texts + fig.texts if "first wrong node" in t.get_text()]
    extent = label.get_window_extent(renderer)
    assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1, \
        (extent, box)


def test_the_stage_time_legend_covers_no_bar():
    timed = [Check("a.kdtr", f"run {i}", Status.EXACT,
                   tables={"stage_seconds": {"device": "cpu", **{s: 0.1 * (i + 1) for s in
                           ("prefill", "topk", "build", "compile", "verify", "accept", "compact")}}})
             for i in range(3)]
    fig = _stage_figure(timed)
    box, renderer = drawn_boxes(fig)
    legend = fig.axes[0].get_legend().get_window_extent(renderer)
    assert box.x0 <= legend.x0 and legend.x1 <= box.x1 and box.y0 <= legend.y0 and legend.y1 <= box.y1
    for bar in fig.axes[0].patches:
        assert not legend.overlaps(bar.get_window_extent(renderer)), "the legend covers a bar"


def test_html_page_in_headless_chromium(failing, failing_page, tmp_path):
    if not headless.CHROMIUM.exists():
        pytest.skip(f"{headless.CHROMIUM} is absent: the browser test runs where Chromium is already installed "
                    f"(Debian: apt-get install -y chromium; CI does not install it, docs/ci.md says why)")
    path = tmp_path / "report.html"
    path.write_text(failing_page)
    page, close = headless.load(path.as_uri())
    try:
        seen = page.evaluate("""(() => {
            const shown = el => { if (!el) return false; const r = el.getBoundingClientRect(), s = getComputedStyle(el);
                                  return r.width > 0 && r.height > 0 && s.visibility !== 'hidden'; };
            const top = el => el.getBoundingClientRect();
            const summary = document.getElementById('summary'), first = summary.querySelector('ul.failures li');
            const fail = document.querySelector('tr.FAIL');
            return {summary: shown(summary) && top(summary).top < innerHeight, text: summary.innerText,
                    listed: shown(first) && top(first).bottom <= innerHeight, fail: shown(fail),
                    failText: fail ? fail.innerText : '',
                    images: [...document.images].map(i => i.complete && i.naturalWidth > 0)};
        })()""")
        shot = page.screenshot(tmp_path / "report-top.png")
    finally:
        close()
    print(f"screenshot of the report's top: {shot}")
    errors = [e for e in page.named("Runtime.consoleAPICalled") if e["type"] in ("error", "assert")]
    errors += page.named("Runtime.exceptionThrown")
    errors += [e for e in page.named("Log.entryAdded") if e["entry"]["level"] == "error"]
    assert errors == []
    urls = [e["request"]["url"] for e in page.named("Network.requestWillBeSent")]
    assert urls and urls[0] == path.as_uri() and all(u == path.as_uri() or u.startswith("data:") for u in urls)
    assert seen["summary"] and failing.summary() in seen["text"] and seen["listed"]
    first = next(c for c in failing.checks if c.status is Status.FAIL)
    assert seen["fail"] and seen["failText"].split() == f"FAIL {first.name} {first.numbers()} {first.detail}".split()
    assert seen["images"] and all(seen["images"])
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
