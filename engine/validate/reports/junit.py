"""The report as JUnit XML (`kdtree validate --junit-xml PATH`), the test-result format CI
systems show natively (GitLab's `artifacts:reports:junit`, Jenkins' junit step, GitHub
Actions through a JUnit report action).

One <testsuite> per section, in report order; one <testcase> per row, classname the
section, name the check. A FAIL row holds a <failure> (message: the row in one line as
the terminal prints it; text: its detail), a skipped or near-tie row a <skipped> whose
message is the row; exact and within-tolerance rows are passing testcases. A run in which
no check ran fails as the report does, with a failing "validate" testcase `any check ran`.
The run's implementation, adapter class, --impl spec, device, fixtures, commit and
versions are each suite's <properties>; times are the runner's seconds per section and the CLI's total.
Characters XML 1.0 cannot hold (control characters in an adapter's error message) are
written as \\xNN. The file is written all or nothing, with the user's umask.
"""

from __future__ import annotations

import io
import os
import re
import socket
import xml.etree.ElementTree as ET
from typing import Iterable

from kdtr_format.clikit import atomic_output

from .report import ANY_CHECK_RAN, REQUIREMENTS, Check, Report, Status

_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(text: str) -> str:
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _seconds(value: float) -> str:
    return f"{value:.3f}"


def _rows(report: Report) -> list[Check]:
    """The report's rows, and the failing `any check ran` row when none ran."""
    if report.executed:
        return report.checks
    return [*report.checks, Check(REQUIREMENTS, ANY_CHECK_RAN, Status.FAIL, detail="no check ran: every row was skipped")]


def to_junit(report: Report) -> ET.Element:
    """The report as a <testsuites> element."""
    rows = _rows(report)
    sections: dict[str, list[Check]] = {}
    for row in rows:
        sections.setdefault(row.section, []).append(row)
    root = ET.Element("testsuites", name=f"kdtree validate: {_xml_text(report.implementation)}",
                      **_counts(rows))
    if "total_seconds" in report.timings:
        root.set("time", _seconds(report.timings["total_seconds"]))
    host = socket.gethostname()
    for section, checks in sections.items():
        suite = ET.SubElement(root, "testsuite", name=_xml_text(section), hostname=host, **_counts(checks))
        if section in report.section_seconds:
            suite.set("time", _seconds(report.section_seconds[section]))
        _properties(suite, report)
        for check in checks:
            _testcase(suite, check)
    return root


def _counts(rows: Iterable[Check]) -> dict[str, str]:
    rows = list(rows)
    skipped = sum(r.status in (Status.SKIPPED, Status.NEAR_TIE) for r in rows)
    return {"tests": str(len(rows)), "failures": str(sum(r.status is Status.FAIL for r in rows)), "errors": "0",
            "skipped": str(skipped)}


def _properties(suite: ET.Element, report: Report) -> None:
    values = {"implementation": report.implementation, "adapter": report.adapter, "impl": report.impl or "",
              "device": report.device, "device_name": report.device_name,
              "fixtures": report.fixtures, "commit": report.commit or "",
              **{f"version.{k}": v or "" for k, v in report.versions.items()},
              **{f"backend.{k}": v for k, v in report.backends.items()}}
    properties = ET.SubElement(suite, "properties")
    for name, value in values.items():
        ET.SubElement(properties, "property", name=name, value=_xml_text(str(value)))


def _testcase(suite: ET.Element, check: Check) -> None:
    case = ET.SubElement(suite, "testcase", classname=_xml_text(check.section), name=_xml_text(check.name))
    if check.status is Status.FAIL:
        failure = ET.SubElement(case, "failure", type="FAIL", message=_xml_text(check.text()))
        failure.text = _xml_text(check.detail)
    elif check.status in (Status.SKIPPED, Status.NEAR_TIE):
        ET.SubElement(case, "skipped", type=check.status.value, message=_xml_text(check.text()))


def junit_bytes(report: Report) -> bytes:
    """The report as JUnit XML (module docstring), indented."""
    tree = ET.ElementTree(to_junit(report))
    ET.indent(tree)
    data = io.BytesIO()
    tree.write(data, encoding="utf-8", xml_declaration=True)
    return data.getvalue()


def write_junit(report: Report, path: str | os.PathLike) -> None:
    """junit_bytes at `path`, all or nothing."""
    with atomic_output(path) as file:
        file.write(junit_bytes(report))
