"""kdtree's pytest plugin: every golden case a test of the engine author's own suite.

Installing kdtree registers it (the `pytest11` entry point named `engine.pytest_plugin`,
the module's own name, so `-p engine.pytest_plugin` or `pytest_plugins = [...]` in a
checkout without the install loads it once, and never twice beside the install). A test
that takes `kdtree_case` runs once per case of engine.validate.run.runner.plan, with the id
`<fixture section>::<check>` (e.g. `tiny.kdtr::prefill logits`):

    from engine.pytest_plugin import assert_passes

    def test_against_kdtree(kdtree_case):
        assert_passes(kdtree_case)

- `kdtree_case`: the case's report row (engine.validate.Check), computed through one
  session-wide `Validation`: a fixture's checks run once, when the first of its cases runs
  (pytest's terminal shows `kdtree: checking <fixture>` as they start). From the first case
  to the end of the session torch runs on the CPU with the thread policy of `kdtree
  validate` (engine.validate.run.runner.prepare_device: one intra-op thread).
- `kdtree_adapter` (session scope): the adapter under test. The plugin's own reads
  `--kdtree-impl module:factory` (or path/to/file.py:factory), else `BUILT_IN`, kdtree's
  built-in engine; a conftest that overrides it (session scope) decides for itself. None
  (a fixture without its `return`) is an error, never the built-in engine.
- An adapter's calls pass the door of engine/validate/door/guard.py: an exception, sys.exit, a
  GeneratorExit or any BaseException but Ctrl-C fails the case naming the method. What
  pytest cannot survive, the adapter cannot either: os._exit, a crash or a call that never
  returns ends or stalls the session (`kdtree validate` runs the adapter in a child process
  and fails the row instead; pytest-timeout bounds a hang).
- `assert_passes(row)`: FAIL fails the test with the row as `kdtree validate` prints it
  (status, check, error against tolerance or margin against threshold, where); skipped and
  near-tie rows skip the test with the row as the reason.
- Options: `--kdtree-fixtures DIR|FILE` (default: the committed fixtures, as `kdtree
  validate`), `--kdtree-impl`, `--kdtree-require CAPS` and `--kdtree-dtype float32|bfloat16`
  (as `kdtree validate --require` and `--dtype`; the dtype's regime names some rows, so it
  is part of the plan).

Ids and their order come from the fixture files alone, never from the adapter or the run,
so `-k`, `-x`, `--lf` and pytest-xdist (every worker collects the same list) behave as for
any test. Each case carries `xdist_group(<section>)`: under `--dist loadgroup` a fixture's
cases share a worker, and its checks run once. The `validate::...` cases (a required
capability exercised; some check ran) need every fixture's checks. Nothing of the engine is
imported until a test asks for a case, so a suite without one pays nothing.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from .validate import Case, Check, Validation

_PLAN = pytest.StashKey["list[Case]"]()


class _BuiltIn:
    def __repr__(self) -> str:
        return "kdtree's built-in engine"


BUILT_IN = _BuiltIn()      # what kdtree_adapter returns for kdtree's built-in engine (its own rows included)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kdtree", "kdtree golden cases (engine/pytest_plugin.py)")
    group.addoption("--kdtree-fixtures", default=None, metavar="DIR|FILE",
                    help="kdtree fixture directory or one .kdtr file (default: the committed golden fixtures)")
    group.addoption("--kdtree-impl", default=None, metavar="MODULE:FACTORY",
                    help="the adapter factory kdtree_adapter returns (default: kdtree's built-in engine)")
    group.addoption("--kdtree-require", default="declared", metavar="CAPS",
                    help="capabilities whose checks must run, as `kdtree validate --require` (default: declared)")
    group.addoption("--kdtree-dtype", default="float32", metavar="DTYPE",
                    help="the adapter's compute dtype and its tolerance regime, as `kdtree validate --dtype` "
                         "(default: float32)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist --dist loadgroup runs a group on one worker")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kdtree_case" not in metafunc.fixturenames:
        return
    config = metafunc.config
    if _PLAN not in config.stash:
        from .validate import ValidateError, plan

        try:
            config.stash[_PLAN] = plan(config.getoption("kdtree_fixtures"), config.getoption("kdtree_dtype"))
        except ValidateError as exc:                  # the module's collection error, in one line
            raise _failure(str(exc).replace("--dtype", "--kdtree-dtype", 1)) from None
    metafunc.parametrize("kdtree_case", [pytest.param(case, id=case.id, marks=pytest.mark.xdist_group(case.section))
                                         for case in config.stash[_PLAN]], indirect=True)


@pytest.fixture(scope="session")
def kdtree_adapter(pytestconfig: pytest.Config) -> Any:
    """The adapter under test: --kdtree-impl's factory's, else BUILT_IN (the built-in engine)."""
    spec = pytestconfig.getoption("kdtree_impl")
    if spec is None:
        return BUILT_IN
    from .validate import load_impl

    try:
        return load_impl(spec)
    except ValueError as exc:               # load_impl names the CLI's option
        raise _failure(str(exc).replace("--impl", "--kdtree-impl", 1)) from None


@pytest.fixture(scope="session")
def kdtree_validation(pytestconfig: pytest.Config, kdtree_adapter: Any) -> Iterator[Validation]:
    """The session's validation run of kdtree_adapter over --kdtree-fixtures, on the CLI's threads
    (torch's own count restored at the end of the session)."""
    import torch

    from .validate import ValidateError, Validation
    from .validate.run.runner import prepare_device

    if kdtree_adapter is None:
        raise _failure("the kdtree_adapter fixture returned None, expected the adapter under test (is its "
                       "`return` missing?); without a kdtree_adapter of its own, a suite checks kdtree's "
                       "built-in engine")
    threads = torch.get_num_threads()
    prepare_device("cpu")
    try:
        yield Validation(None if kdtree_adapter is BUILT_IN else kdtree_adapter, pytestconfig.getoption("kdtree_fixtures"),
                         require=pytestconfig.getoption("kdtree_require"), dtype=pytestconfig.getoption("kdtree_dtype"),
                         log=_progress(pytestconfig))
    except ValidateError as exc:
        raise _failure(exc) from None
    finally:
        torch.set_num_threads(threads)


def _progress(config: pytest.Config) -> Callable[[str], None]:
    """The runner's log on pytest's terminal, a line of its own each (`kdtree: checking tiny.kdtr`)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def show(line: str) -> None:
        if reporter is None:           # an xdist worker: no terminal of its own
            return
        writer = config.get_terminal_writer()
        with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
            if writer.width_of_current_line:           # after a run of progress dots
                writer.line()
            writer.line(f"kdtree: {line}")
    return show


@pytest.fixture
def kdtree_case(request: pytest.FixtureRequest, kdtree_validation: Validation) -> Check:
    """This case's report row (the test's parameter: an engine.validate.Case)."""
    from .validate import ValidateError

    if not hasattr(request, "param"):
        pytest.fail("kdtree_case is parametrized by the kdtree plugin; use it as a test's argument", pytrace=False)
    try:
        return kdtree_validation.check(request.param)
    except ValidateError as exc:
        raise _failure(exc) from None


def _failure(error: Exception | str) -> BaseException:
    """pytest's failure with kdtree's one-line message and no traceback (raise it `from None`)."""
    return pytest.fail.Exception(f"kdtree: {error}", pytrace=False)


def assert_passes(row: Check) -> None:
    """Fail on a FAIL row, skip on a skipped or near-tie row, each with the row's text."""
    from .validate import Status

    if row.status is Status.FAIL:
        pytest.fail(row.text(), pytrace=False)
    if row.status is Status.NEAR_TIE:
        pytest.skip(row.text())
    if row.status is Status.SKIPPED:
        pytest.skip(f"{row.section}::{row.name}: {row.detail}")
