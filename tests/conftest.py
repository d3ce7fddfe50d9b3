"""Suite-wide settings and the golden fixtures.

Without a CUDA GPU, Triton's kernels run in its interpreter (TRITON_INTERPRET=1), which
patches Triton's language once per launch and module (tests/triton_interpreter.py).

Single-threaded BLAS and torch: the suite runs on 2-core CI machines next to other
processes; threaded BLAS there costs far more in contention than it gains, and one
thread also keeps float reduction order fixed from run to run.

The golden fixtures are committed slim (docs/fixtures.md, "Slim and full"):
- `golden`: the directory of the full fixtures, every tensor, tests/golden materialized
  once (engine.validate.find_fixtures: a cache directory named by the committed files'
  content, written all or nothing, so pytest-xdist workers may race for it);
- `open_golden("tiny.kdtr")`: a reader of one full fixture, closed after the test;
- `committed_golden`: tests/golden itself, for the tests of the committed files.

Under `--dist loadfile` (ci/gate's), the files whose few tests run long start first
(LONG_FEW_TEST_FILES).

Ctrl-C raises KeyboardInterrupt, as in a terminal, even where the suite was started with SIGINT
ignored (a non-interactive shell's background job: `cmd &`): the tests that press Ctrl-C on a
CLI, in this process or in a child that inherits the disposition, need it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable, Iterator

import pytest

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _no_cuda_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


# Without a GPU the Triton kernels (engine/fused) run in Triton's interpreter, on CPU tensors;
# set before any kernel is defined (Triton reads it when a kernel is decorated).
if "TRITON_INTERPRET" not in os.environ and _no_cuda_gpu():
    os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_once_per_launch

    patch_once_per_launch()          # the same kernels' arithmetic, without redone patching

COMMITTED_GOLDEN = Path(__file__).resolve().parent / "golden"

# pytest-xdist hands out files by their number of tests, most first: these files of few long tests
# would start last and run on while the other worker idles. test_fused_compiles.py's one test compiles
# every fused launch: 60 s on 2 cores with Triton's cache cold (3 s warm); the others 10-30 s each.
LONG_FEW_TEST_FILES = ("tests/engine/test_fused_compiles.py", "tests/test_optional_dependencies.py",
                       "tests/refgen/test_export_mtp.py", "tests/engine/test_engines_docs.py",
                       "tests/engine/test_server_sampling.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` handing out LONG_FEW_TEST_FILES first, then xdist's own order (other modes:
    xdist's own scheduler)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            for scope in reversed(LONG_FEW_TEST_FILES):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongFilesFirst(config, log)


@pytest.fixture(scope="session")
def committed_golden() -> Path:
    return COMMITTED_GOLDEN


@pytest.fixture(scope="session")
def golden() -> Path:
    from engine.validate import find_fixtures

    return find_fixtures(COMMITTED_GOLDEN)


@pytest.fixture
def open_golden(golden: Path) -> Iterator[Callable]:
    import kdtr_format

    readers = []

    def _open(relative: str) -> kdtr_format.Reader:
        readers.append(kdtr_format.open(golden / relative))
        return readers[-1]

    yield _open
    for reader in readers:
        reader.close()
