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


def rewrite(path: Path, change) -> None:
    """The fixture at `path` written again after change(tensors, metadata), its content_hash anew."""
    with kdtr_format.open(path) as reader:
        tensors = {n: np.array(reader[n]) for n in reader.names()}
        metadata = reader.metadata
    change(tensors, metadata)
    metadata["content_hash"] = content_hash(metadata, tensors)
    kdtr_format.write(path, tensors, metadata)


def test_a_changed_fixture_gets_a_copy_of_its_own(committed_golden, cache, tmp_path):
    """The key is the content, not the names: an edited fixture is materialized anew, never
    served the copy of what it was."""
    source = slim_dir(committed_golden, tmp_path / "slim")
    before = find_fixtures(source)
    scores = "cases/beyond_possible/scores"

    def edit(tensors, metadata):
        tensors[scores] = tensors[scores] + 1.0

    rewrite(source / KERNELS[1], edit)
    after = find_fixtures(source)
    assert after != before and entries(cache) == sorted([before.name, after.name])
    with kdtr_format.open(source / KERNELS[1]) as slim, kdtr_format.open(after / KERNELS[1]) as copy:
        assert np.array_equal(copy[scores], slim[scores])


def scaled_seeded_tensor(copy: Path) -> None:
    """One seeded tensor scaled by 1.5, the file otherwise valid (its hashes made anew)."""
    def scale(tensors, metadata):
        tensors["cases/no_match/c_kv"] = tensors["cases/no_match/c_kv"] * np.float32(1.5)
    rewrite(copy, scale)


def another_fixture(copy: Path) -> None:
    shutil.copy(copy.parent / "tree_build.kdtr", copy)


def one_byte_in_place_mtime_kept(copy: Path) -> None:
    """Its middle byte flipped where the file lies (same inode and size), its mtime put back."""
    info = copy.stat()
    with open(copy, "r+b") as file:
        file.seek(info.st_size // 2)
        byte = file.read(1)
        file.seek(info.st_size // 2)
        file.write(bytes([byte[0] ^ 0xFF]))
    os.utime(copy, ns=(info.st_atime_ns, info.st_mtime_ns))


@pytest.mark.parametrize("tamper, problem", [
    (scaled_seeded_tensor, r"cases/no_match/c_kv is not the tensor the slim file records \(dtype, shape and sha256\)"),
    (another_fixture, r"its metadata differs from the slim file's \(another fixture\?\)"),
    (one_byte_in_place_mtime_kept, r"data checksum mismatch: .*"),
], ids=lambda value: getattr(value, "__name__", None))
def test_a_copy_that_is_not_its_slim_file_is_refused_naming_it(committed_golden, cache, tmp_path, tamper, problem):
    source = slim_dir(committed_golden, tmp_path / "slim")
    found = find_fixtures(source)
    assert find_fixtures(source) == found                     # checked and stamped
    copy = found / KERNELS[0]
    tamper(copy)
    with pytest.raises(ValidateError, match=rf"^the fixture cache's {copy} is not the materialized "
                                            rf"{source / KERNELS[0]}: {problem}; remove {found} \(the next run "
                                            r"materializes it again\)$"):
        find_fixtures(source)


def test_a_copy_is_checked_once_until_it_changes(committed_golden, cache, tmp_path, monkeypatch):
    checked: list[str] = []
    problem = engine.validate.fixture_cache._copy_problem
    monkeypatch.setattr(engine.validate.fixture_cache, "_copy_problem",
                        lambda copy, source: checked.append(copy.name) or problem(copy, source))
    source = slim_dir(committed_golden, tmp_path / "slim")
    found = find_fixtures(source)
    assert sorted(checked) == ["accept_compact.kdtr", "tree_build.kdtr"]
    find_fixtures(source)
    assert len(checked) == 2                                  # the stamp holds: nothing read again
    os.utime(found / KERNELS[1])                              # touched: checked again (and still good)
    assert find_fixtures(source) == found and checked[2:] == ["tree_build.kdtr"]


def test_a_stale_staging_directory_goes_and_a_live_one_stays(committed_golden, cache, tmp_path):
    """A staging directory left by a killed run is removed by the next; one a live run holds is not."""
    cache.mkdir(parents=True)
    stale, live = cache / ".fixtures.killed", cache / ".fixtures.running"
    for staging in (stale, live):
        (staging / "kernels").mkdir(parents=True)
        (staging / "kernels" / "tree_build.kdtr").write_bytes(b"half written")
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        found = find_fixtures(slim_dir(committed_golden, tmp_path / "slim"))
    finally:
        os.close(held)
    assert entries(cache) == sorted([found.name, live.name])


def test_ctrl_c_while_materializing_leaves_no_staging(committed_golden, cache, tmp_path, capsys, monkeypatch):
    """Ctrl-C reaches `kdtree validate` while refgen materializes in its checking process: exit 130,
    and the cache holds no staging directory (nor a copy)."""
    parent, run = os.getpid(), subprocess.run

    def ctrl_c_then_run(command, *args, **kwargs):
        if os.getpid() != parent and "refgen" in command:
            os.kill(parent, signal.SIGINT)
        return run(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", ctrl_c_then_run)
    source = slim_dir(committed_golden, tmp_path / "slim")
    code, _, err = run_main(["validate", "--fixtures", str(source), "--impl",
                             f"{HOSTILE}:Stages", "--require", "none"], capsys)
    assert code == 130 and err.splitlines()[-1] == "kdtree: error: interrupted", err
    assert entries(cache) == []
