"""docs/serving.md's `kdtree validate --server` commands run as written against the fake servers
(tests/fake_servers.py): each line of its "Validating" block, the server's URL and the export's
directory put in for the placeholders, passes against a faithful server of its API (a
speculative one publishing vLLM's counters for the --require-speculation line). The engine
commands themselves need the engines: scripts/engines runs them (docs/results/engines.md)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from cli_run import run_main
from fake_servers import FakeServer

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def validate_lines() -> list[str]:
    """The `kdtree validate` lines of the Validating section's code block, comments dropped."""
    section = DOC.read_text().split("\n## Validating\n", 1)[1]
    block = section.split("```", 2)[1]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.startswith("kdtree validate")]


def test_the_section_has_the_commands():
    lines = validate_lines()
    assert len(lines) >= 5 and any("--require-speculation" in line for line in lines)
    assert any("--temperature" in line for line in lines) and any("--api sglang" in line for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("line", validate_lines())
def test_each_command_runs_as_written(line, engine, export_dir, capsys):
    argv = shlex.split(line)
    api = argv[argv.index("--api") + 1] if "--api" in argv else "openai"
    speculative = "--require-speculation" in argv
    batch = int(argv[argv.index("--concurrency") + 1]) if "--concurrency" in argv else 1     # requests in flight
    with FakeServer(engine, api, batch=batch, speculative=speculative, metrics="vllm" if speculative else None) as server:
        args = [server.url if re.fullmatch(r"URL|http://127\.0\.0\.1:\d+", a) else
                str(export_dir) if a == "/models/tiny-f32" else a for a in argv[1:]]
        code, out, err = run_main(args, capsys)
    assert code == 0, f"{line}\n{out}{err}"
    assert "PASSED" in out
