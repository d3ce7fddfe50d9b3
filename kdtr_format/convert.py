"""Lossless conversion between KDTR and HDF5 (h5py), npz and safetensors, chosen by extension.

Formats that cannot hold a dtype natively keep its raw bits plus a dtype note:

- HDF5 (.h5, .hdf5): one dataset per tensor at the tensor's name (each `/` a group level);
  bfloat16 / float8 stored as uint16 / uint8 bits and int4 as int8 values, with the
  dataset attribute `kdtr_dtype`; `kdtr_index` keeps the tensor order; the metadata is the
  root attribute `kdtr_metadata` (JSON text, ASCII with \\u escapes, so every string survives).
- npz: one array per tensor (same raw-bits rule); the entry `__kdtr__` holds, as ASCII JSON
  bytes, {"metadata": ..., "dtypes": {name: kdtr dtype}} for the exotic tensors.
- safetensors: native BF16 / F8_E4M3 / F8_E5M2; int4 as I8 values; 0-d tensors keep their
  shape []; `__metadata__` holds `kdtr_metadata`, `kdtr_dtypes` and `kdtr_order` (JSON text).

Files not written by kdtr convert are read too (their metadata is then empty, except
safetensors' string map, which becomes the metadata object); what a foreign file holds that
KDTR cannot (a string dataset, a pickled array) is an error naming the tensor. Only the
bytes of the file itself are read: an HDF5 dataset with external storage, a virtual
dataset or an external link is an error naming it (as safetensors reads nothing outside
its file).
Every output is written beside its target and renamed (`atomic`): a failure leaves nothing
behind, the file gets the user's umask, and errors name the user's path.
"""

from __future__ import annotations

import errno
import json
import os
import zipfile
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from . import atomic
from . import format as fmt
from .errors import KdtrError
from .reader import Reader
from .writer import Writer

EXTENSIONS = {".kdtr": "kdtr", ".h5": "hdf5", ".hdf5": "hdf5", ".npz": "npz", ".safetensors": "safetensors"}
_EXOTIC_BITS = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}
_NPZ_INFO = "__kdtr__"
_SAFETENSORS_DTYPES = {
    "BOOL": np.bool_, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
    "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
    "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


class ConvertError(KdtrError, ValueError):
    """The conversion cannot be done (extension, missing library, unrepresentable name)."""


@dataclass
class Source:
    """Tensors to stream, in order, and the metadata object."""

    names: list[str]
    load: Callable[[str], np.ndarray]
    metadata: dict
    close: Callable[[], None]


def kind_of(path: str) -> str:
    extension = os.path.splitext(path)[1].lower()
    if extension not in EXTENSIONS:
        raise ConvertError(f"unsupported extension {extension or '(none)'!r} of {path}; use one of {', '.join(EXTENSIONS)}")
    return EXTENSIONS[extension]


def _to_stored(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    """(array a plain format can hold, kdtr dtype note or None when the dtype is native)."""
    name = array.dtype.name
    if name in _EXOTIC_BITS:
        return array.view(_EXOTIC_BITS[name]), name
    if name == "int4":
        return array.astype(np.int8), name
    return array, None


def _from_stored(array: np.ndarray, note: str | None) -> np.ndarray:
    if note is None:
        return array
    if note in _EXOTIC_BITS:
        return array.view(getattr(ml_dtypes, note))
    if note == "int4":
        return array.astype(ml_dtypes.int4)
    raise ConvertError(f"unknown dtype note {note!r}")


def _h5py():
    try:
        import h5py
    except ImportError:
        raise ConvertError("HDF5 conversion needs h5py (pip install h5py)") from None
    return h5py


def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ConvertError("safetensors conversion needs the safetensors package (pip install safetensors)") from None
    return safetensors


def open_source(path: str) -> Source:
    """The tensors and metadata of `path`; a foreign file KDTR cannot take in is a ConvertError."""
    kind = kind_of(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    if kind == "kdtr":
        reader = Reader(path)
        try:
            return Source(reader.names(), reader.__getitem__, reader.metadata, reader.close)
        except BaseException:
            reader.close()
            raise
    opener = {"hdf5": _open_h5, "npz": _open_npz, "safetensors": _open_safetensors}[kind]
    try:
        source = opener(path)
    except KdtrError:
        raise
    except Exception as e:          # whatever h5py, numpy, zipfile or safetensors raise on a file they cannot read
        raise ConvertError(f"cannot read {path} as {kind}: {_reason(e)}") from None

    def load(name: str) -> np.ndarray:
        try:
            return source.load(name)
        except KdtrError:
            raise
        except Exception as e:
            raise ConvertError(f"cannot read tensor {name!r} of {path}: {_reason(e)}") from None

    return Source(source.names, load, source.metadata, source.close)


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _json_object(text: str | bytes, what: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ConvertError(f"{what} is not a JSON object")
    return value


def _open_h5(path: str) -> Source:
    h5py = _h5py()
    f = h5py.File(path, "r")
    found: list[tuple[int, str]] = []

    def visit(name: str, node) -> None:
        if isinstance(node, h5py.Dataset):
            _refuse_outside_data(path, name, node)
            found.append((int(node.attrs.get("kdtr_index", len(found) + 10**9)), name))

    def visit_link(name: str, link) -> None:      # an exception raised here comes out of h5py mangled
        if isinstance(link, h5py.ExternalLink):
            external.append((name, link.filename))

    try:
        external: list[tuple[str, str]] = []
        f.visititems_links(visit_link)
        if external:
            name, target = external[0]
            raise ConvertError(f"{path}: {name!r} is an external link (to {target!r}); kdtr reads only "
                               "what the file itself holds")
        f.visititems(visit)
        raw = f.attrs.get("kdtr_metadata")
        metadata = _json_object(raw, "attribute kdtr_metadata") if raw is not None else {}
    except BaseException:
        f.close()
        raise

    def load(name: str) -> np.ndarray:
        dataset = f[name]
        note = dataset.attrs.get("kdtr_dtype")
        return _from_stored(dataset[()], note.decode() if isinstance(note, bytes) else note)

    return Source([n for _, n in sorted(found)], load, metadata, f.close)


def _refuse_outside_data(path: str, name: str, dataset) -> None:
    """ConvertError for a dataset whose bytes lie in other files: HDF5 external storage or a
    virtual dataset would read any file on disk into the output."""
    if dataset.external:
        raise ConvertError(f"{path}: {name!r} stores its data in another file "
                           f"({dataset.external[0][0]!r}); kdtr reads only what the file itself holds")
    if dataset.is_virtual:
        raise ConvertError(f"{path}: {name!r} is a virtual dataset (its data lies in other "
                           "files); kdtr reads only what the file itself holds")


def _open_npz(path: str) -> Source:
    archive = np.load(path, allow_pickle=False)
    info = _json_object(archive[_NPZ_INFO].tobytes(), f"entry {_NPZ_INFO}") if _NPZ_INFO in archive.files else {}
    notes = info.get("dtypes", {})
    names = [n for n in archive.files if n != _NPZ_INFO]
    return Source(names, lambda n: _from_stored(archive[n], notes.get(n)), info.get("metadata", {}), archive.close)


def _open_safetensors(path: str) -> Source:
    safetensors = _safetensors()
    with open(path, "rb") as f:
        blob = f.read()
    header = safetensors.safe_open(path, framework="numpy").metadata() or {}
    views = {name: view for name, view in safetensors.deserialize(blob)}
    notes = json.loads(header.get("kdtr_dtypes", "{}"))
    order = json.loads(header["kdtr_order"]) if "kdtr_order" in header else sorted(views)
    metadata = _json_object(header["kdtr_metadata"], "kdtr_metadata") if "kdtr_metadata" in header else dict(header)

    def load(name: str) -> np.ndarray:
        view = views[name]
        if view["dtype"] not in _SAFETENSORS_DTYPES:
            raise ConvertError(f"tensor {name!r} has safetensors dtype {view['dtype']}, which KDTR does not store")
        array = np.frombuffer(view["data"], _SAFETENSORS_DTYPES[view["dtype"]]).reshape(view["shape"])
        return _from_stored(array, notes.get(name))

    return Source(order, load, metadata, lambda: None)


def _npz_member(archive: zipfile.ZipFile, name: str, array: np.ndarray) -> None:
    """One `<name>.npy` entry, as numpy.savez writes it."""
    with archive.open(name + ".npy", "w", force_zip64=True) as member:
        np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def _h5_path(name: str) -> str:
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ConvertError(f"tensor name {name!r} cannot be an HDF5 path (empty, '.' or '..' component)")
    return name


def convert(src: str, dst: str, alignment: int = fmt.DEFAULT_ALIGNMENT,
            progress: Callable[[int, int], None] | None = None) -> int:
    """Copy every tensor and the metadata from src to dst (formats by extension); returns the tensor count.

    `progress(done, total)` is called after each tensor."""
    kind = kind_of(dst)
    source = open_source(src)
    done = iter(range(1, len(source.names) + 1))

    def step(name: str) -> None:
        if progress is not None:
            progress(next(done), len(source.names))

    try:
        if kind == "kdtr":
            with Writer(dst, alignment=alignment, metadata=source.metadata) as writer:
                for name in source.names:
                    writer.add(name, source.load(name))
                    step(name)
        elif kind == "hdf5":
            h5py = _h5py()
            with atomic.replacing(dst) as tmp, h5py.File(tmp, "w") as f:
                f.attrs["kdtr_metadata"] = json.dumps(source.metadata)
                for i, name in enumerate(source.names):
                    stored, note = _to_stored(source.load(name))
                    try:
                        dataset = f.create_dataset(_h5_path(name), data=stored)
                    except (ValueError, TypeError) as e:
                        raise ConvertError(f"cannot store tensor {name!r} in HDF5: {e}") from None
                    dataset.attrs["kdtr_index"] = i
                    if note:
                        dataset.attrs["kdtr_dtype"] = note
                    step(name)
        elif kind == "npz":
            notes = {}
            with atomic.replacing(dst) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                for name in source.names:
                    if name == _NPZ_INFO:
                        raise ConvertError(f"tensor name {_NPZ_INFO!r} is reserved in npz")
                    stored, note = _to_stored(source.load(name))
                    _npz_member(archive, name, stored)
                    if note:
                        notes[name] = note
                    step(name)
                info = json.dumps({"metadata": source.metadata, "dtypes": notes}).encode()
                _npz_member(archive, _NPZ_INFO, np.frombuffer(info, np.uint8))
        else:
            safetensors = _safetensors()
            arrays, notes = {}, {}
            for name in source.names:
                array = source.load(name)
                if array.dtype.name == "int4":
                    array, notes[name] = array.astype(np.int8), "int4"
                arrays[name] = array if array.flags.c_contiguous else array.copy(order="C")   # keeps 0-d shapes
                step(name)
            header = {"kdtr_metadata": json.dumps(source.metadata),
                      "kdtr_dtypes": json.dumps(notes), "kdtr_order": json.dumps(source.names)}
            with atomic.replacing(dst) as tmp:
                safetensors.numpy.save_file(arrays, tmp, metadata=header)
    finally:
        source.close()
    return len(source.names)
