"""engine.validate.find_fixtures on slim fixtures: materialized once by `refgen materialize`
into a cache directory named by their content (a file keeps its name, a directory its
layout), found again without work, all or nothing when refgen fails, one copy when two
processes race for it; full fixtures are used where they are; a slim file where weights
are needed says how to materialize it."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import engine.validate.fixture_cache
import kdtr_format
from cli_run import run_main
from engine.validate import ValidateError, find_fixtures
from engine.validate.fixture_cache import LOCK
from engine.weights import load_fixture_weights
from refgen.files import content_hash

KERNELS = ("kernels/accept_compact.kdtr", "kernels/tree_build.kdtr")
HOSTILE = Path(__file__).with_name("hostile_adapters.py")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def slim_dir(committed_golden: Path, where: Path) -> Path:
    for name in KERNELS:
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(committed_golden / name, where / name)
    return where


def entries(cache: Path) -> list[str]:
    """What the cache holds, but its lock file."""
    return sorted(p.name for p in cache.iterdir() if p.name != LOCK)


def full_names(path: Path) -> set[str]:
    with kdtr_format.open(path) as reader:
        assert set(reader.metadata["seeded_tensors"]) <= set(reader.names()), path
        return set(reader.names())


def test_slim_fixtures_are_materialized_once(committed_golden, cache, tmp_path):
    source = slim_dir(committed_golden, tmp_path / "slim")
    found = find_fixtures(source)
    assert found.parent == cache and found.name.startswith("golden-")
    assert sorted(str(p.relative_to(found)) for p in found.rglob("*.kdtr")) == sorted(KERNELS)
    assert "cases/random_b16/c_kv" in full_names(found / KERNELS[0])
    assert "cases/random/draft_logits" in full_names(found / KERNELS[1])
    modified = (found / KERNELS[0]).stat().st_mtime_ns
    assert find_fixtures(source) == found and (found / KERNELS[0]).stat().st_mtime_ns == modified
    assert entries(cache) == [found.name]                                        # no staging left
    one = find_fixtures(source / KERNELS[1])                                      # a file: its own key, its name
    assert one.name == "tree_build.kdtr" and one.parent.parent == cache and one.parent != found
    assert "cases/random/draft_logits" in full_names(one)


def test_full_fixtures_are_used_where_they_are(golden, cache):
    assert find_fixtures(golden) == golden and find_fixtures(golden / "tiny.kdtr") == golden / "tiny.kdtr"
    assert not cache.exists()


def test_two_processes_racing_leave_one_complete_copy(committed_golden, cache, tmp_path):
    source = slim_dir(committed_golden, tmp_path / "slim")
    found: list[Path] = []
    racers = [threading.Thread(target=lambda: found.append(find_fixtures(source))) for _ in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert len(found) == 2 and found[0] == found[1]
    assert entries(cache) == [found[0].name]
    for name in KERNELS:
        full_names(found[0] / name)


def test_a_failed_materialization_leaves_nothing(committed_golden, cache, tmp_path):
    """The second file fails, after the first is written: neither reaches the cache."""
    source = slim_dir(committed_golden, tmp_path / "slim")
    path = source / KERNELS[1]
    with kdtr_format.open(path) as reader:
        tensors = {n: np.array(reader[n]) for n in reader.names()}
        metadata = reader.metadata
    metadata["seeded_tensors"]["cases/random/draft_logits"]["sha256"] = "0" * 64
    metadata["content_hash"] = content_hash(metadata, tensors)
    kdtr_format.write(path, tensors, metadata)
    with pytest.raises(ValidateError, match=r"holds slim fixtures and `refgen materialize` failed: refgen: error: "
                                            r".*cases/random/draft_logits: drawn again from seed 0"):
        find_fixtures(source)
    assert entries(cache) == []


def test_an_unwritable_cache_is_one_clear_error(committed_golden, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "file" / "cache"))          # under a file: no directory
    with pytest.raises(ValidateError, match=r"cannot write the fixture cache .*file/cache: .*set KDTREE_CACHE_DIR"):
        find_fixtures(committed_golden / "tiny2.kdtr")


def test_a_slim_file_where_weights_are_needed_says_how_to_materialize(committed_golden):
    with pytest.raises(ValueError, match=r"tiny2.kdtr: a slim fixture: .* `refgen materialize \S+tiny2.kdtr --out DIR`"):
        load_fixture_weights(committed_golden / "tiny2.kdtr")
