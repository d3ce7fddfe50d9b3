"""An engine's own test against kdtree's golden cases: one test per case, ids such as
`tiny.kdtr::verify logits` (docs/ci.md). Copy it into your suite; name your adapter with
`pytest --kdtree-impl my_engine.kdtree:make_adapter`, or return it from a session-scoped
`kdtree_adapter` fixture in your conftest.py (without either, kdtree's built-in engine)."""

from engine.pytest_plugin import assert_passes


def test_against_kdtree(kdtree_case):
    assert_passes(kdtree_case)
