"""ci/lowest_versions.py: the floor environment reuses the running interpreter's packages, and
refuses, by name, a package a floor cannot import beside."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("lowest_versions", REPO / "ci" / "lowest_versions.py")
lowest_versions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lowest_versions)


def purelib(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())


def test_the_floor_environment_reuses_the_virtual_environment_it_is_run_from(tmp_path: Path) -> None:
    """Run from a virtual environment (as a user's torch lives in one), the floor environment sees that
    environment's packages, not only the base interpreter's."""
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(outer)], check=True)
    outer_python = outer / "bin" / "python"
    (purelib(outer_python) / "only_in_the_outer_venv.py").write_text("WHERE = 'outer'\n")
    build = ("import importlib.util, sys; from pathlib import Path\n"
             "spec = importlib.util.spec_from_file_location('lv', sys.argv[1])\n"
             "lv = importlib.util.module_from_spec(spec); spec.loader.exec_module(lv)\n"
             "print(lv.create_environment(Path(sys.argv[2]), pip=False))")     # nothing installed: no ensurepip
    floor_python = subprocess.run([str(outer_python), "-c", build, str(REPO / "ci" / "lowest_versions.py"),
                                   str(tmp_path / "floor")], check=True, capture_output=True, text=True).stdout
    seen = subprocess.run([floor_python.strip(), "-c", "import only_in_the_outer_venv as m, packaging; "
                           "print(m.WHERE)"], capture_output=True, text=True)
    assert seen.returncode == 0 and seen.stdout == "outer\n", seen.stderr[-500:]


def fake_distribution(directory: Path, name: str, version: str) -> Path:
    """A directory that makes `name` look installed at `version` to importlib.metadata (PYTHONPATH)."""
    info = directory / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return directory


def test_a_kernels_release_transformers_floor_cannot_import_beside_is_refused_by_name(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """transformers 5.25 brings kernels 0.19; transformers 5.6 fails at import beside it."""
    monkeypatch.setenv("PYTHONPATH", str(fake_distribution(tmp_path / "new", "kernels", "0.19.1")))
    refusal = lowest_versions.held_back_refusal(sys.executable)
    assert refusal is not None and "kernels 0.19.1, outside kernels>=0.12.0,<0.13" in refusal
    assert "transformers 5.6" in refusal and "\n" not in refusal
    monkeypatch.setenv("PYTHONPATH", str(fake_distribution(tmp_path / "held", "kernels", "0.12.0")))
    assert lowest_versions.held_back_refusal(sys.executable) is None

