"""KDTR reader: mmap, validate the layout at open, hand out zero-copy views.

Opening reads only the header, trailer, index and metadata and checks them (`index.parse_layout`;
10k tensors cost a few milliseconds). Three checks wait until they are needed, and `verify()` does
all of them at once:

- a tensor's CRC32C (and, for bool tensors, that every byte is 0 or 1) on its first access;
- the metadata's JSON grammar when `metadata` is first read: building Python objects for metadata
  at the 64 MiB cap can take seconds, and many readers never look.

The file is mapped copy-on-write: numpy arrays are read-only views, torch tensors share the mapping
and may be written, which never reaches the file (but is seen by other views of the same tensor from
this reader).

A file truncated or rewritten in place while a reader has it open: `verify()` reads through the file
descriptor, so it reports a shorter file as a FormatError; an array already handed out, or a first
access, touches the mapping, and reading past the new end of file is a bus error (SIGBUS), as with
any memory-mapped file. kdtr's own writer never does this: it renames a new file over the old one,
and open readers keep the old file.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from . import format as fmt
from . import metadata as md
from ._crc32c import crc32c
from .errors import ChecksumError, FormatError, TensorNotFoundError, in_file
from .index import Layout, check_size, parse_layout

_VERIFY_CHUNK = 16 << 20
_SHAPE_BLOCK_BITS = 12
_BOOL = fmt.DTYPE_BY_NAME["bool"]
_INT4 = fmt.DTYPE_BY_NAME["int4"]


class TensorInfo(NamedTuple):
    """Where and what one tensor is: `nbytes` is the stored length (int4: packed)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32c: int


class Reader:
    """A validated, memory-mapped KDTR file. Use `kdtr_format.open(path)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self.path)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(errno.EINVAL, "Not a regular file", self.path)
            with self._in_this_file():
                check_size(info.st_size)
            buffer = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._attach(buffer, info.st_size)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, name: str = "<memory>") -> "Reader":
        """Validate a KDTR image held in memory (copied into a private buffer)."""
        reader = cls.__new__(cls)
        reader.path = name
        with reader._in_this_file():
            check_size(len(data))
        reader._fd = None
        reader._attach(bytearray(data), len(data))
        return reader

    def _attach(self, buffer: mmap.mmap | bytearray, size: int) -> None:
        if sys.byteorder != "little":
            raise FormatError("the KDTR Python reader needs a little-endian host")
        self._mm = buffer
        self._size = size
        try:
            with self._in_this_file():
                layout = parse_layout(buffer, size)
        except BaseException:
            self.close()
            raise
        self._bytes = np.frombuffer(buffer, np.uint8)      # writable (copy-on-write): torch tensors
        self._readonly = memoryview(buffer).toreadonly()    # numpy arrays
        self.version, self.alignment = layout.version, layout.alignment
        self._names = layout.names
        self._index = layout.positions
        self._columns = layout.columns
        self._offsets = layout.columns.offset.tolist()
        self._nbytes = layout.columns.nbytes.tolist()
        self._dtypes = layout.columns.dtype.tolist()
        self._crcs = layout.columns.crc32c.tolist()
        self._ndims = layout.columns.ndim.tolist()
        self._shape_blocks: dict[int, list[int]] = {}
        self._checked = bytearray(len(layout.names))
        self._metadata_raw: bytes | None = layout.metadata
        self._metadata_at = layout.metadata_at
        self._metadata: dict | None = None

    @contextmanager
    def _in_this_file(self) -> Iterator[None]:
        """A FormatError raised inside is marked as this file's (`in_file`): a command reading two
        files says which is broken."""
        try:
            yield
        except FormatError as exc:
            raise in_file(exc, self.path)

    # ---- access --------------------------------------------------------------------------

    def _position(self, name: str) -> int:
        try:
            return self._index[name]
        except (KeyError, TypeError):
            raise TensorNotFoundError(str(name), self.path) from None

    def _check_crc(self, i: int, actual: int) -> None:
        expected = self._crcs[i]
        if actual != expected:
            raise ChecksumError("data", self._offsets[i], expected, actual, tensor=self._names[i])
        self._checked[i] = 1

    def _check_bools(self, i: int, raw: np.ndarray, at: int) -> None:
        """Bool tensors hold bytes 0 and 1 only; `raw` [k] uint8 are bool tensor i's bytes from file offset `at`."""
        if raw.size and raw.max() > 1:
            bad = int(np.argmax(raw > 1))
            raise FormatError(f"bool byte {int(raw[bad])} is not 0 or 1", offset=at + bad, tensor=self._names[i])

    def _raw_checked(self, i: int) -> np.ndarray:
        offset = self._offsets[i]
        raw = self._bytes[offset : offset + self._nbytes[i]]
        if not self._checked[i]:
            with self._in_this_file():
                if self._dtypes[i] == _BOOL.code:
                    self._check_bools(i, raw, offset)
                self._check_crc(i, crc32c(raw))
        return raw

    def _shape(self, i: int) -> tuple[int, ...]:
        # Shapes become Python ints a block of 4096 tensors at a time, as one flat list: cheap to
        # open, cheap to scan, and one object for the garbage collector per block, not per tensor.
        block = self._shape_blocks.get(i >> _SHAPE_BLOCK_BITS)
        if block is None:
            start = i >> _SHAPE_BLOCK_BITS << _SHAPE_BLOCK_BITS
            rows = self._columns.shape[start : start + (1 << _SHAPE_BLOCK_BITS)]
            block = self._shape_blocks[i >> _SHAPE_BLOCK_BITS] = rows.reshape(-1).tolist()
        at = (i & ((1 << _SHAPE_BLOCK_BITS) - 1)) * fmt.MAX_NDIM
        return tuple(block[at : at + self._ndims[i]])

    def __getitem__(self, name: str) -> np.ndarray:
        """Read-only numpy array of a tensor, zero-copy over the mapping (int4: an unpacked copy)."""
        i = self._position(name)
        raw = self._raw_checked(i)
        dtype = fmt.DTYPE_BY_CODE[self._dtypes[i]]
        shape = self._shape(i)
        if dtype is _INT4:
            array = fmt.unpack_int4(raw, int(np.prod(shape, dtype=np.int64))).reshape(shape)
            array.flags.writeable = False
            return array
        return np.frombuffer(self._readonly, dtype.numpy, raw.size // dtype.itemsize, self._offsets[i]).reshape(shape)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor as a read-only uint8 [nbytes] view (int4 stays packed)."""
        i = self._position(name)
        self._raw_checked(i)
        return np.frombuffer(self._readonly, np.uint8, self._nbytes[i], self._offsets[i])

    def torch(self, name: str) -> Any:
        """A torch tensor sharing the copy-on-write mapping (int4: an int8 copy; torch has no int4)."""
        import torch

        i = self._position(name)
        raw = self._raw_checked(i)
        dtype = fmt.DTYPE_BY_CODE[self._dtypes[i]]
        if dtype is _INT4:
            return torch.from_numpy(self[name].astype(np.int8))
        return torch.from_numpy(raw).view(getattr(torch, dtype.name)).reshape(self._shape(i))

    def info(self, name: str) -> TensorInfo:
        i = self._position(name)
        return TensorInfo(name, fmt.DTYPE_BY_CODE[self._dtypes[i]].name, self._shape(i), self._offsets[i],
                          self._nbytes[i], self._crcs[i])

    def names(self, prefix: str | None = None) -> list[str]:
        """Tensor names in file order; with `prefix`, those that start with it (plain string prefix)."""
        if prefix is None:
            return list(self._names)
        return [n for n in self._names if n.startswith(prefix)]

    @property
    def metadata(self) -> dict:
        """The metadata JSON object as Python objects, parsed on first use (FormatError if it is not valid JSON)."""
        if self._metadata is None:
            with self._in_this_file():
                self._metadata = md.parse(self._metadata_raw, self._metadata_at)
            self._metadata_raw = None
        return self._metadata

    def verify(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Check the metadata JSON and every tensor's CRC32C and bool values; the error names the
        first bad tensor; returns the tensor bytes checked. Reads through the file descriptor, so
        a file that shrank since it was opened is a FormatError, not a fault.

        `progress(done_bytes, total_bytes)` is called as the check advances."""
        self.metadata
        with self._in_this_file():
            return self._verify_tensors(progress)

    def _verify_tensors(self, progress: Callable[[int, int], None] | None) -> int:
        total = sum(self._nbytes)
        done = reported = 0
        window = _Window(self)
        for i in range(len(self._names)):
            offset, size = self._offsets[i], self._nbytes[i]
            crc = 0
            for start in range(offset, offset + size, _VERIFY_CHUNK):
                piece = window.read(start, min(_VERIFY_CHUNK, offset + size - start), i)
                if self._dtypes[i] == _BOOL.code:
                    self._check_bools(i, piece, start)
                crc = crc32c(piece, crc)
                done += piece.size
                if progress is not None and done - reported >= 1 << 20:
                    progress(done, total)
                    reported = done
            self._check_crc(i, crc)
        if progress is not None:
            progress(done, total)
        return done

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._index

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def close(self) -> None:
        """Drop the mapping; arrays handed out keep it alive until they are gone."""
        for name in ("_readonly", "_bytes"):
            view = getattr(self, name, None)
            setattr(self, name, None)
            if isinstance(view, memoryview):
                try:
                    view.release()
                except BufferError:
                    pass
        mm, self._mm = getattr(self, "_mm", None), None
        if isinstance(mm, mmap.mmap):
            try:
                mm.close()
            except BufferError:
                pass
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kdtr_format.Reader {self.path!r}: {len(self)} tensors>"


class _Window:
    """Reads of the tensor region for `verify()`, up to 16 MiB at a time: through the file descriptor
    (a short read means the file shrank) or, for an image in memory, straight from it."""

    def __init__(self, reader: Reader):
        self.reader = reader
        self.storage = np.empty(0, np.uint8)    # [<= 16 MiB] uint8, allocated on the first read
        self.start = self.stop = 0              # the file bytes storage[: stop - start] holds

    def read(self, start: int, length: int, i: int) -> np.ndarray:
        """[length] uint8: the file's bytes from `start` (length <= 16 MiB), for tensor i."""
        r = self.reader
        if r._fd is None:
            return r._bytes[start : start + length]
        if not (self.start <= start and start + length <= self.stop):
            if self.storage.size == 0:
                self.storage = np.empty(min(_VERIFY_CHUNK, r._size), np.uint8)
            got = os.preadv(r._fd, [self.storage], start)
            if got < length:
                size = os.fstat(r._fd).st_size
                raise FormatError(f"the file is {size} bytes now, {r._size} when it was opened (changed while open?)",
                                  offset=start + got, tensor=r._names[i])
            self.start, self.stop = start, start + got
        return self.storage[start - self.start : start - self.start + length]


def open(path: str | os.PathLike) -> Reader:
    """Open and validate a KDTR file (see `Reader`)."""
    return Reader(path)
