"""Fixture files: the content hash, the atomic write (full or slim), and the checks of a
file against its own metadata.

Seeded tensors. Some tensors of a fixture are drawn from its seed, and numpy's PCG64
stream gives them bit for bit on every machine: a model fixture's `weights/...` and
`bf16/weights/...` (when refgen.weights.init_weights drew them, not a checkpoint) and
the random inputs of the kernel cases (`SEEDED_INPUTS`). Every fixture records each
one's dtype, shape and sha256 in its metadata (`seeded_tensors`). A slim file (what is
committed and what `refgen generate` writes) omits them; a full one (`refgen
materialize`, `refgen generate --full`) holds them. Every expected output is in both.
content_hash covers the metadata and the tensors the file holds, so that a slim file's
hash covers its omitted tensors through their checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Mapping

import numpy as np

import kdtr_format
from kdtr_format.seeded import SEEDED_KEY, omitted, recorded_seeded, slim_hint  # noqa: F401 (refgen uses them from here)

from .fixtures import Fixture

SEEDED_SOURCES = ("preset", "config-file")      # model fixtures whose weights init_weights draws
# The kernel cases' random inputs, by kind (tensor names under cases/<case>/). The corpus keeps
# its inputs: each is shaped by hand to show its bug, and they are small.
SEEDED_INPUTS = {
    "tree_build": ("draft_logits",),
    "verify_attention": ("q_lat", "q_pe", "c_kv", "k_pe"),
    "accept_compact": ("c_kv", "k_pe"),
    "paged_kv": ("q_lat", "q_pe", "c_kv_pages", "k_pe_pages"),
    "corpus": (),
}


def seeded_names(metadata: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """Which of `names` (a fixture's tensors) are drawn from its seed, in name order."""
    kind = metadata.get("kind")
    if kind == "model":
        if metadata.get("source") not in SEEDED_SOURCES:
            return []
        chosen = [n for n in names if n.startswith(("weights/", "bf16/weights/"))]
    else:
        leaves = SEEDED_INPUTS.get(kind, ())
        chosen = [n for n in names if n.startswith("cases/") and n.rsplit("/", 1)[-1] in leaves]
    return _sorted_names(chosen)


def checksum(array: np.ndarray) -> dict[str, Any]:
    """What the metadata records of a seeded tensor: dtype, shape, sha256 of its
    little-endian C-order bytes."""
    array = np.asarray(array)
    return {"dtype": str(array.dtype), "shape": list(array.shape),
            "sha256": hashlib.sha256(_little_endian_bytes(array)).hexdigest()}


def seeded_problems(reader: Any) -> list[str]:
    """The seeded tensors a file holds whose dtype, shape or sha256 is not the one its
    metadata records, one line each; a malformed record is one line too."""
    recorded = reader.metadata.get(SEEDED_KEY, {})
    if not isinstance(recorded, dict) or not all(
            isinstance(r, dict) and {"dtype", "shape", "sha256"} <= r.keys() for r in recorded.values()):
        return [f"metadata.{SEEDED_KEY}: malformed (name -> dtype, shape, sha256)"]
    held = set(reader.names())
    problems = []
    for name, expected in recorded.items():
        if name in held:
            actual = checksum(np.asarray(reader[name]))
            if actual != expected:
                problems.append(f"{name}: {_describe(actual)} stored, the metadata records {_describe(expected)}")
    return problems


def _describe(record: Mapping[str, Any]) -> str:
    return f"{record['dtype']}{list(record['shape'])} sha256 {str(record['sha256'])[:16]}..."


def _little_endian_bytes(array: np.ndarray) -> memoryview:
    """The array's little-endian C-order bytes (a view when it is already so laid out)."""
    array = np.ascontiguousarray(array)
    return memoryview(array.astype(array.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8))


def _metadata_digest(metadata: Mapping[str, Any]) -> Any:
    """sha256 fed with the canonical metadata JSON (content_hash removed)."""
    digest = hashlib.sha256()
    body = {k: v for k, v in metadata.items() if k != "content_hash"}
    digest.update(json.dumps(body, sort_keys=True, separators=(",", ":"),
                             allow_nan=False).encode("ascii"))
    return digest


def _sorted_names(tensors: Iterable[str]) -> list[str]:
    return sorted(tensors, key=lambda n: n.encode("utf-8"))


def content_hash(metadata: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 hex of the canonical metadata JSON (content_hash removed, keys sorted,
    no spaces, ASCII) followed by every tensor's little-endian C-order bytes in
    name order (sorted by UTF-8 bytes)."""
    digest = _metadata_digest(metadata)
    for name in _sorted_names(tensors):
        digest.update(_little_endian_bytes(np.asarray(tensors[name])))
    return digest.hexdigest()


def write_fixture(path: str | os.PathLike, fixture: Fixture, slim: bool = False) -> None:
    """Write a fixture atomically (tensors in name order), its seeded tensors' checksums
    (`seeded_tensors`) and content_hash added; `slim`: without the seeded tensors. Each
    tensor is read from `fixture.tensors` once to be written (a seeded one once more to be
    hashed), so a mapping that makes its tensors on demand keeps one in memory at a time."""
    names = _sorted_names(fixture.tensors)
    seeded = seeded_names(fixture.metadata, names)
    metadata = {k: v for k, v in fixture.metadata.items() if k != SEEDED_KEY}
    if seeded:
        metadata[SEEDED_KEY] = {name: checksum(fixture.tensors[name]) for name in seeded}
    omit = set(seeded) if slim else set()
    kept = [name for name in names if name not in omit]
    digest = _metadata_digest(metadata)
    with kdtr_format.Writer(path, metadata=metadata) as writer:
        for name in kept:
            array = np.asarray(fixture.tensors[name])
            digest.update(_little_endian_bytes(array))
            writer.add(name, array)
        writer.metadata = {**metadata, "content_hash": digest.hexdigest()}


def stored_hash_problem(reader: Any) -> str | None:
    """None when a fixture file's content_hash matches its content, else what is wrong."""
    metadata = reader.metadata
    if "content_hash" not in metadata:
        return "metadata: content_hash is missing"
    actual = content_hash(metadata, {name: reader[name] for name in reader.names()})
    if actual != metadata["content_hash"]:
        return f"content_hash: stored {metadata['content_hash'][:16]}..., content gives {actual[:16]}..."
    return None
