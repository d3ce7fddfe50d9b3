"""Fixtures for the KDTR tests; the material itself lives in kdtr_testlib."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdtr_testlib import CORRUPTIONS, corrupt, small_file


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """The valid small file (`valid.kdtr`) and one file per corruption (`<name>.kdtr`)."""
    directory = tmp_path_factory.mktemp("kdtr_corpus")
    valid = small_file(directory / "valid.kdtr").read_bytes()
    for case in CORRUPTIONS:
        (directory / f"{case.name}.kdtr").write_bytes(corrupt(valid, case))
    (directory / "empty.kdtr").write_bytes(b"")
    (directory / "truncated.kdtr").write_bytes(valid[: len(valid) // 2])
    return directory
