"""The KdtrError family: every problem with a KDTR file or a fixture config.

- `FormatError`: the file is malformed (names the problem and the offset or tensor).
  - `VersionError`: a major version this library does not know.
  - `ChecksumError`: stored and computed CRC32C differ (names the tensor, or "index"/"metadata").
- `TensorNotFoundError`: no tensor of that name (also a `KeyError`).
- `WriterError`: the writer was handed something it cannot store (bad name, dtype, metadata, option).
"""

from __future__ import annotations


class KdtrError(Exception):
    """Base of every error this package raises on bad input. `path`: the file it is about, where
    a reader found it (`in_file`); the command lines print it before the message."""

    path: str | None = None


def in_file(error: KdtrError, path: str) -> KdtrError:
    """`error`, marked as being about the file `path` (the first mark stays)."""
    if error.path is None:
        error.path = path
    return error


class FormatError(KdtrError, ValueError):
    """A malformed KDTR file. `offset` is the absolute file offset of the problem, when known."""

    def __init__(self, message: str, offset: int | None = None, tensor: str | None = None):
        where = []
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if offset is not None:
            where.append(f"offset {offset}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.offset = offset
        self.tensor = tensor


class VersionError(FormatError):
    """The file's major version is not one this library reads."""


class ChecksumError(FormatError):
    """CRC32C mismatch; `tensor` is the tensor name, or None for the index, metadata or trailer."""

    def __init__(self, what: str, offset: int, expected: int, actual: int, tensor: str | None = None):
        super().__init__(
            f"{what} checksum mismatch: stored crc32c {expected:#010x}, computed {actual:#010x}",
            offset=offset,
            tensor=tensor,
        )
        self.expected = expected
        self.actual = actual


class TensorNotFoundError(KdtrError, KeyError):
    """No tensor of that name in the file."""

    def __init__(self, name: str, path: str):
        super().__init__(f"no tensor named {name!r} in {path}")
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])


class WriterError(KdtrError, ValueError):
    """The writer cannot store what it was given."""
