"""The report as one self-contained HTML page (`kdtree validate --html PATH`).

Top to bottom: the summary (verdict, counts, implementation, adapter class and --impl
spec, device, fixtures, commit, versions, time) and the FAIL rows in one line each; then
per section a plot of every row's error against its tolerance (error / tolerance on a log scale, the tolerance at 1; rows
without a float error are named with their status) and the section's rows (status,
check, numbers, detail); then for each failing row that names its first wrong node
(tables["first_wrong_node"]: verify logits, target or sampled choices) the round's tree
with that node marked and the fixture's accepted path drawn; the acceptance lengths per
trace (tables["acceptance_lengths"]; for the built-in engine's own runs, from
tables["acceptance"]); and the seconds per stage of the timed runs
(tables["stage_seconds"]) and per section.

Plots are matplotlib figures embedded as PNG data URIs; the page loads nothing else (no
script, no font, no network). It needs matplotlib (the `plot` extra). Written all or
nothing, with the user's umask.
"""

from __future__ import annotations

import base64
import html
import io
import os
from typing import Any, Iterable, Mapping

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kdtr_format.clikit import atomic_output, shown

from .report import Check, Report, Status

COLORS = {Status.EXACT: "#2e7d32", Status.WITHIN: "#2e7d32", Status.NEAR_TIE: "#e0a000", Status.SKIPPED: "#9e9e9e",
          Status.FAIL: "#c62828"}
FLOOR = 1e-12                      # error / tolerance below this (an error of 0) is drawn at the floor
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1180px; color: #1b1b1b; }
h1 { font-size: 22px; margin: 0 0 8px; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.summary { border: 2px solid; border-radius: 6px; padding: 10px 16px; margin-bottom: 16px; }
.summary.PASSED { border-color: #2e7d32; } .summary.FAILED { border-color: #c62828; }
.verdict { font-size: 20px; font-weight: 700; } .PASSED .verdict { color: #2e7d32; } .FAILED .verdict { color: #c62828; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 14px; margin: 8px 0 0; }
dt { color: #555; } dd { margin: 0; font-family: ui-monospace, monospace; word-break: break-all; }
table { border-collapse: collapse; width: 100%; margin: 6px 0 12px; }
th, td { text-align: left; vertical-align: top; padding: 3px 8px; border-bottom: 1px solid #eee; }
td.numbers, td.detail { font-family: ui-monospace, monospace; font-size: 12.5px; }
td.detail { word-break: break-word; }
tr.FAIL { background: #fdecea; } tr.near-tie { background: #fff8e1; } tr.skipped { color: #777; }
.status { font-weight: 600; white-space: nowrap; }
ul.failures li { font-family: ui-monospace, monospace; font-size: 12.5px; margin-bottom: 4px; }
img { max-width: 100%; display: block; margin: 6px 0; }
"""


def to_html(report: Report) -> str:
    """The page (module docstring). Every text from the fixtures or the adapter is shown through
    `shown` (a lone surrogate or a control character as its escape), and plot labels are never
    read as mathtext (a `$` in a name is a dollar sign)."""
    with matplotlib.rc_context({"text.parse_math": False}):
        return _page(report)


def _page(report: Report) -> str:
    sections: dict[str, list[Check]] = {}
    for check in report.checks:
        sections.setdefault(check.section, []).append(check)
    parts = [f"<h1>kdtree validate: {_e(report.implementation)}</h1>", _summary(report)]
    for section, rows in sections.items():
        parts += [f'<h2 id="{_anchor(section)}">{_e(section)}</h2>',
                  _image(_tolerance_figure(rows), f"error against tolerance, every row of {shown(section)}"),
                  _rows_table(rows)]
    wrong = [c for c in report.checks if c.status is Status.FAIL and "first_wrong_node" in c.tables]
    if wrong:
        parts.append("<h2>First wrong node of failing rounds</h2>")
        for check in wrong:
            node = check.tables["first_wrong_node"]
            parts += [f"<h3>{_e(check.section)}: {_e(check.name)}, trace {_e(node['trace'])} round {node['round']}</h3>",
                      _image(_tree_figure(node), f"the tree of trace {shown(node['trace'])} round {node['round']}, "
                                                 f"node {node['node']} marked")]
    accepted = [c for c in report.checks if acceptance_lengths(c)]
    if accepted:
        parts.append("<h2>Acceptance lengths</h2>")
        for check in accepted:
            parts += [f"<h3>{_e(check.section)}: {_e(check.name)}</h3>",
                      _image(_acceptance_figure(acceptance_lengths(check)), f"acceptance lengths, {shown(check.name)}")]
    parts.append(_timing(report))
    title = f"kdtree validate: {report.implementation}: {'FAILED' if report.failed else 'PASSED'}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(parts) + "\n</body></html>\n")


def write_html(report: Report, path: str | os.PathLike) -> None:
    """The page at `path`, all or nothing."""
    page = to_html(report).encode()
    with atomic_output(path) as file:
        file.write(page)


def acceptance_lengths(check: Check) -> dict[str, list[int]]:
    """A row's acceptance lengths (tokens committed per round) per trace, or for its whole run
    (from the accepted ranks: a round that accepted a nodes past the root commits a + 1)."""
    if check.tables.get("acceptance_lengths"):
        return check.tables["acceptance_lengths"]
    if "acceptance" in check.tables:
        return {check.name: [len(ranks) + 1 for ranks in check.tables["acceptance"]["accepted_ranks"]]}
    return {}


def _e(text: Any) -> str:
    return html.escape(shown(text))


def _anchor(text: str) -> str:
    return "s-" + "".join(ch if ch.isalnum() else "-" for ch in text)


def _summary(report: Report) -> str:
    verdict = "FAILED" if report.failed else "PASSED"
    facts = {"implementation": report.implementation,
             "adapter": f"{report.adapter} ({f'--impl {report.impl}' if report.impl else 'built-in'})",
             "device": f"{report.device} {report.device_name}".strip(),
             "fixtures": report.fixtures, "commit": report.commit or "unknown",
             "versions": ", ".join(f"{k} {v}" for k, v in report.versions.items() if v),
             "backends": ", ".join(f"{k}: {v}" for k, v in report.backends.items())}
    if "total_seconds" in report.timings:
        facts["time"] = f"{report.timings['total_seconds']:.1f} s"
    listed = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in facts.items() if v)
    failures = [c for c in report.checks if c.status is Status.FAIL]
    failing = ""
    if failures:
        items = "".join(f'<li><a href="#{_anchor(c.section)}">{_e(c.text())}</a></li>' for c in failures)
        failing = f'<h3>FAIL rows</h3><ul class="failures">{items}</ul>'
    deviations = "".join(f"<li>{_e(fixture)}: {_e(d.line())}</li>" for fixture, ds in report.deviations.items()
                         for d in ds)
    if deviations:
        deviations = f"<h3>Known deviations declared by the implementation</h3><ul>{deviations}</ul>"
    return (f'<section class="summary {verdict}" id="summary"><div class="verdict">{_e(report.summary())}</div>'
            f"<dl>{listed}</dl>{failing}{deviations}</section>")


def _rows_table(rows: Iterable[Check]) -> str:
    body = "".join(f'<tr class="{_e(c.status.value)}"><td class="status" style="color:{COLORS[c.status]}">'
                   f"{_e(c.status.value)}</td><td>{_e(c.name)}</td><td class=\"numbers\">{_e(c.numbers())}</td>"
                   f'<td class="detail">{_e(c.detail)}</td></tr>' for c in rows)
    return f"<table><tr><th>status</th><th>check</th><th>numbers</th><th>detail</th></tr>{body}</table>"


def _timing(report: Report) -> str:
    timed = [c for c in report.checks if "stage_seconds" in c.tables]
    parts = []
    if timed:
        parts += ["<h2>Time per stage</h2>", _image(_stage_figure(timed), "seconds per stage of the timed runs")]
    if report.section_seconds:
        rows = "".join(f"<tr><td>{_e(s)}</td><td class=\"numbers\">{t:.2f}</td></tr>"
                       for s, t in report.section_seconds.items())
        parts += ["<h2>Time per section</h2>", f"<table><tr><th>section</th><th>seconds</th></tr>{rows}</table>"]
    return "\n".join(parts)


def _image(fig: Figure, alt: str) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96)
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _tolerance_figure(rows: list[Check]) -> Figure:
    """One bar per row: error / tolerance on a log scale; the tolerance is the line at 1."""
    fig = Figure(figsize=(11, 0.32 * len(rows) + 1.1))
    ax = _axes(fig, left=2.6, bottom=0.6, right=1.6, top=0.15)
    ratios = [c.error / c.tolerance if c.error is not None and c.tolerance and c.margin is None else None
              for c in rows]
    top = max([10.0, *(3 * r for r in ratios if r)])
    y = np.arange(len(rows))
    for i, (check, ratio) in enumerate(zip(rows, ratios)):
        if ratio is not None:
            value = max(ratio, FLOOR)
            ax.barh(i, value - FLOOR, left=FLOOR, color=COLORS[check.status], height=0.6)
            ax.text(value * 1.3, i, check.measure(), va="center", fontsize=8)
        else:
            ax.text(FLOOR * 2, i, f"{check.status.value}{': ' + check.measure() if check.measure() else ''}",
                    va="center", fontsize=8, color=COLORS[check.status])
    ax.axvline(1.0, color="#444", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlim(FLOOR, top)
    ax.set_yticks(y, [shown(c.name) for c in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("error / tolerance (log scale; dashed: the tolerance; an error of 0 at the left edge)")
    return fig


def _tree_figure(node: Mapping[str, Any]) -> Figure:
    """The round's tree, root on top, children under their parent in tree order; the fixture's
    accepted path in blue, the first wrong node and its path from the root in red."""
    parents = node["parents"]
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        children[p].append(i)
    x = np.zeros(len(parents))
    depth = np.zeros(len(parents), dtype=int)
    leaves = 0
    stack = [(0, False)]
    while stack:                                  # depth-first: leaves left to right, parents centred
        i, done = stack.pop()
        if done or not children[i]:
            if children[i]:
                x[i] = np.mean(x[children[i]])
            else:
                x[i], leaves = leaves, leaves + 1
            continue
        stack.append((i, True))
        for c in reversed(children[i]):
            depth[c] = depth[i] + 1
            stack.append((c, False))
    wrong = int(node["node"])
    path = [wrong]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    accepted = set(node.get("accepted", []))
    fig = Figure(figsize=(max(6.0, min(11.0, 1.5 + 0.4 * leaves)), 1.4 + 0.8 * (depth.max() + 1)))
    ax = _axes(fig, left=0.8, bottom=0.5, top=0.55)
    for i in range(1, len(parents)):
        p = parents[i]
        on_path, on_accepted = i in path, i in accepted and p in accepted
        ax.plot([x[p], x[i]], [-depth[p], -depth[i]], color="#c62828" if on_path else "#1565c0" if on_accepted
                else "#bbb", linewidth=2.2 if on_path or on_accepted else 1, zorder=1)
    colors = ["#c62828" if i == wrong else "#1565c0" if i in accepted else "#fff" for i in range(len(parents))]
    ax.scatter(x, -depth, s=[260 if i == wrong else 120 for i in range(len(parents))], c=colors,
               edgecolors="#333", zorder=2)
    if len(parents) <= 96:
        for i in range(len(parents)):
            ax.text(x[i], -depth[i], str(i), ha="center", va="center", fontsize=6.5, zorder=3,
                    color="#fff" if i == wrong or i in accepted else "#000")
    width, height = fig.get_size_inches()         # the label under the axes, from their left edge: never cut
    fig.text(0.8 / width, 0.12 / height,
             f"first wrong node {wrong} (depth {node['depth']}, position {node['position']})",
             color="#c62828", fontsize=9, fontweight="bold", ha="left", va="bottom")
    ax.set_yticks(-np.arange(depth.max() + 1), [f"depth {d}" for d in range(depth.max() + 1)], fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(-0.8, leaves - 0.2)
    ax.set_ylim(-depth.max() - 0.8, 0.5)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"trace {shown(node['trace'])} round {node['round']}, {len(parents)} nodes\nblue: the reference's "
                 "accepted path; red: the first wrong node and its path", fontsize=9)
    return fig


def _acceptance_figure(lengths: Mapping[str, list[int]]) -> Figure:
    """The histogram of tokens committed per round, one bar colour per trace (or run)."""
    fig = Figure(figsize=(11, 2.8))
    ax = _axes(fig, left=0.6, bottom=0.5)
    top = max(2, *(max(v, default=1) for v in lengths.values()))
    width = 0.8 / len(lengths)
    for i, (name, values) in enumerate(lengths.items()):
        counts = np.bincount(np.asarray(values, dtype=np.int64), minlength=top + 1)[1:]
        mean = f"mean {np.mean(values):.2f}, " if values else ""
        ax.bar(np.arange(1, top + 1) + (i - (len(lengths) - 1) / 2) * width, counts, width=width,
               label=f"{shown(name)} ({mean}{len(values)} rounds)")
    ax.set_xticks(range(1, top + 1, max(1, top // 16)))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tokens committed per round", fontsize=9)
    ax.set_ylabel("rounds", fontsize=9)
    ax.legend(fontsize=8, ncols=min(len(lengths), 5))
    return fig


def _axes(fig: Figure, left: float, bottom: float, top: float = 0.3, right: float = 0.3):
    """One axes inside margins given in inches (matplotlib's automatic layouts cost seconds)."""
    width, height = fig.get_size_inches()
    return fig.add_axes((left / width, bottom / height, 1 - (left + right) / width, 1 - (bottom + top) / height))


def _stage_figure(rows: list[Check]) -> Figure:
    """Seconds per stage, one stacked bar per timed run."""
    stages = [k for k in rows[0].tables["stage_seconds"] if k != "device"]
    fig = Figure(figsize=(11, 0.45 * len(rows) + 1.6))
    ax = _axes(fig, left=3.2, bottom=0.6, top=0.5)
    left = np.zeros(len(rows))
    for stage in stages:
        seconds = np.array([float(c.tables["stage_seconds"].get(stage, 0.0)) for c in rows])
        ax.barh(np.arange(len(rows)), seconds, left=left, label=stage, height=0.6)
        left += seconds
    device = rows[0].tables["stage_seconds"].get("device")
    ax.set_yticks(np.arange(len(rows)), [shown(f"{c.section}: {c.name}") for c in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel(f"seconds{f' on {shown(device)}' if device else ''}")
    ax.legend(ncols=min(len(stages), 8), fontsize=8, loc="lower left", bbox_to_anchor=(0, 1),   # above the bars
              frameon=False)
    return fig
