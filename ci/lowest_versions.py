"""The lowest declared versions: every dependency of pyproject.toml at the floor of its range.

    python3 ci/lowest_versions.py          # what ci/gate's `lowest-versions` step runs

A virtual environment over the main one (--system-site-packages, so torch and everything
not pinned is reused) gets each dependency of `dependencies` and of the `test` extra at its
`>=` floor, torch excepted (docs/versions.md says why). In it run the tests that talk to
those libraries (TESTS) and one `kdtree validate` of the HF adapter on a small fixture.
Exit 0 when the install and every check pass; the environment is removed either way.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
NOT_PINNED = {"torch": "no CPU build of its floor on PyPI; CI has torch 2.13.0, the GPU image 2.11.0",
              "triton": "its floor is the GPU image's 3.6, where the fused kernels compile and are tested "
                        "(scripts/gpu_all.sh); CI runs them in the newest one's interpreter"}
# The tests that talk to the pinned libraries: transformers (the HF adapter, HF as an outside
# oracle), compressed-tensors and safetensors (checkpoint import), h5py and click (kdtr
# convert and CLI), matplotlib and xmlschema (the reports), scipy (the sampling laws).
TESTS = ["tests/engine/test_hf_adapter.py", "tests/refgen/test_checkpoint_hf.py",
         "tests/refgen/test_model.py::test_model_matches_hf_transformers",
         "tests/refgen/test_model.py::test_yarn_rope_matches_hf_rotary_code",
         "tests/test_schema.py::test_transformers_own_deepseek_v3_config_round_trips",
         "tests/refgen/test_checkpoint_import.py", "tests/refgen/test_checkpoint_errors.py",
         "tests/engine/test_checkpoint_fixture.py", "tests/kdtr/test_kdtr_tools.py", "tests/kdtr/test_kdtr_cli.py",
         "tests/kdtr/test_kdtr_metadata.py", "tests/engine/test_reports.py", "tests/engine/test_sampling.py",
         "tests/test_optional_dependencies.py"]
VALIDATED = "tiny2.kdtr"        # grouped routing, no q_lora: the fixture the version differences meet


def floors(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """`name==floor` for every `>=` requirement of `dependencies` and the `test` extra, less NOT_PINNED."""
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = {}
    for line in project["dependencies"] + project["optional-dependencies"]["test"]:
        requirement = Requirement(line)
        floor = [s.version for s in requirement.specifier if s.operator == ">="]
        if requirement.name not in NOT_PINNED and floor:
            pins[requirement.name] = f"{requirement.name}=={floor[0]}"
    return list(pins.values())


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kdtree-lowest-") as tmp:
        venv = Path(tmp) / "venv"
        python = str(venv / "bin" / "python")
        pins = floors()
        print(f"lowest-versions: {' '.join(pins)} (not pinned: {', '.join(NOT_PINNED)})", flush=True)
        steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                 [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pins],
                 [python, "-m", "pytest", *TESTS, "-p", "no:cacheprovider", "-q", "-rs", "-m", "not slow",
                  "-n", "auto", "--dist", "loadfile"],
                 [python, "-c", "import sys; from engine.cli import main; from engine.validate.fixtures import "
                  "find_fixtures; main(['validate', '--impl', 'engine.adapters.hf:HFAdapter', '--fixtures', "
                  f"str(find_fixtures(None) / {VALIDATED!r})])"]]
        for name, command in zip(("venv", "install", "tests", "validate"), steps):
            start = time.monotonic()
            status = subprocess.run(command, cwd=ROOT).returncode
            print(f"lowest-versions: {name} took {time.monotonic() - start:.0f} s", flush=True)
            if status:
                print(f"lowest-versions: {name} failed (exit {status})", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
