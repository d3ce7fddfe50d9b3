"""The lowest declared versions: every dependency of pyproject.toml at the floor of its range.

    python3 ci/lowest_versions.py          # what ci/gate's `lowest-versions` step runs

A virtual environment over the running interpreter's (torch and everything not pinned is
reused; nothing there changes) gets each dependency of `dependencies` and of the `test` extra
at its `>=` floor, torch excepted (docs/versions.md says why), and the packages a floor needs
held back (HELD_BACK). In it run the tests that talk to those libraries (TESTS) and one
`kdtree validate` of the HF adapter on a small fixture. Exit 0 when the install and every
check pass, 1 otherwise; the environment is removed either way.
"""

from __future__ import annotations

import contextlib
import site
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Iterator

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
NOT_PINNED = {"torch": "no CPU build of its floor on PyPI; CI has torch 2.13.0, the GPU image 2.11.0",
              "triton": "its floor is the GPU image's 3.6, where the fused kernels compile and are tested "
                        "(scripts/gpu_all.sh); CI runs them in the newest one's interpreter"}
# Not dependencies of this project, but present beside the newest releases (transformers 5.25
# requires kernels 0.19) and outside the range a floor declares for them: held at that range.
HELD_BACK = {"kernels": ("kernels>=0.12.0,<0.13", "transformers 5.6 declares kernels<0.13; with a newer one its "
                         "import fails (\"Either a revision or a version must be specified\")")}
# The tests that talk to the pinned libraries: transformers (the HF adapter, HF as an outside
# oracle), compressed-tensors and safetensors (checkpoint import), h5py and click (kdtr
# convert and CLI), matplotlib and xmlschema (the reports), scipy (the sampling laws),
# prometheus_client (a server's /metrics).
TESTS = ["tests/engine/test_hf_adapter.py", "tests/refgen/test_checkpoint_hf.py",
         "tests/refgen/test_model.py::test_model_matches_hf_transformers",
         "tests/refgen/test_model.py::test_yarn_rope_matches_hf_rotary_code",
         "tests/test_schema.py::test_transformers_own_deepseek_v3_config_round_trips",
         "tests/refgen/test_checkpoint_import.py", "tests/refgen/test_checkpoint_errors.py",
         "tests/refgen/test_checkpoint_partial.py", "tests/refgen/test_checkpoint_references.py",
         "tests/kdtr/test_kdtr_errors.py", "tests/kdtr/test_checkpoint_tensors.py",
         "tests/engine/test_checkpoint_fixture.py", "tests/kdtr/test_kdtr_tools.py", "tests/kdtr/test_kdtr_cli.py",
         "tests/kdtr/test_kdtr_metadata.py", "tests/engine/test_reports.py", "tests/engine/test_sampling.py",
         "tests/test_optional_dependencies.py", "tests/engine/test_speculation.py"]
VALIDATED = "tiny2.kdtr"        # grouped routing, no q_lora: the fixture the version differences meet


def pin_at_floor(line: str) -> str | None:
    """`name==floor` of a requirement line with a `>=` bound; None without one."""
    requirement = Requirement(line)
    floor = [s.version for s in requirement.specifier if s.operator == ">="]
    return f"{requirement.name}=={floor[0]}" if floor else None


def floors(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """`name==floor` for every `>=` requirement of `dependencies` and the `test` extra, less NOT_PINNED."""
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = {Requirement(line).name: pin_at_floor(line)
            for line in project["dependencies"] + project["optional-dependencies"]["test"]}
    return [pin for name, pin in pins.items() if name not in NOT_PINNED and pin]


def create_environment(venv: Path, pip: bool = True) -> str:
    """A virtual environment at `venv` whose interpreter sees the running one's packages behind its own.

    `venv --system-site-packages` reaches only the base interpreter's site-packages, not those of a
    virtual environment the script runs from: a .pth file adds the running interpreter's site
    directories (and the .pth files in them). Returns the new interpreter's path. pip: install pip
    into it (ensurepip: about 10 s on 2 cores); False for an environment nothing is installed into
    (tests/test_lowest_versions.py).
    """
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", *([] if pip else ["--without-pip"]),
                    str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    reused = "; ".join(f"site.addsitedir({directory!r})" for directory in site.getsitepackages())
    (Path(purelib) / "kdtree-reused-environment.pth").write_text(f"import site; {reused}\n")
    return python


def held_back_pins() -> list[str]:
    """`name==floor` of each HELD_BACK range: the lowest release it allows."""
    return [pin_at_floor(allowed) for allowed, _ in HELD_BACK.values()]


def held_back_refusal(python: str) -> str | None:
    """One line naming each HELD_BACK package `python` sees outside its range, and why; None when none is."""
    wrong = []
    for name, (allowed, why) in HELD_BACK.items():
        found = subprocess.run([python, "-c", "import importlib.metadata, sys; "
                                "print(importlib.metadata.version(sys.argv[1]))", name],
                               capture_output=True, text=True)
        installed = found.stdout.strip()
        if found.returncode == 0 and not Requirement(allowed).specifier.contains(installed, prereleases=True):
            wrong.append(f"{name} {installed}, outside {allowed}: {why}")
    return "; ".join(wrong) or None


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Prints how long the step `name` took."""
    start = time.monotonic()
    yield
    print(f"lowest-versions: {name} took {time.monotonic() - start:.0f} s", flush=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kdtree-lowest-") as tmp:
        pins = floors()
        print(f"lowest-versions: {' '.join(pins)} (not pinned: {', '.join(NOT_PINNED)}; held back: "
              f"{', '.join(held_back_pins())})", flush=True)
        try:
            with timed("venv"):
                python = create_environment(Path(tmp) / "venv")
        except subprocess.CalledProcessError as error:
            print(f"lowest-versions: venv failed (exit {error.returncode})", file=sys.stderr)
            return 1
        steps = {"install": [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pins,
                             *held_back_pins()],
                 "tests": [python, "-m", "pytest", *TESTS, "-p", "no:cacheprovider", "-q", "-rs", "-m", "not slow",
                           "-n", "auto", "--dist", "loadfile"],
                 "validate": [python, "-c", "from engine.cli import main; from engine.validate import "
                              "find_fixtures; main(['validate', '--impl', 'engine.adapters.hf:HFAdapter', "
                              f"'--fixtures', str(find_fixtures(None) / {VALIDATED!r})])"]}
        for name, command in steps.items():
            with timed(name):
                status = subprocess.run(command, cwd=ROOT).returncode
            if status:
                print(f"lowest-versions: {name} failed (exit {status})", file=sys.stderr)
                return 1
            if name == "install" and (refusal := held_back_refusal(python)):
                print(f"lowest-versions: the floor environment sees {refusal}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
