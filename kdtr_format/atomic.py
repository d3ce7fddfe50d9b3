"""Replacing a file atomically: write a temporary file beside it, then rename it over the target.

Every file kdtr writes (KDTR, HDF5, npz, safetensors) goes this way:

- The temporary file lies in the target's directory, so the rename stays on one file system and is
  atomic: a reader sees the old file or the new one, never part of either.
- Its name is `.<name>.<random>.tmp`, with <name> cut short (at a character boundary) so the whole
  stays within the file system's name limit (NAME_MAX, 255 bytes on Linux): a 255-byte target
  name works.
- It is created with mode 0666 less the process umask, the permissions any new file of the user
  gets (not the 0600 of `tempfile.mkstemp`). A replaced file does not pass its mode on.
- Writing through a symbolic link writes the file the link points to (the link stays), as `cp` and
  `open(path, "w")` do; a dangling link creates its target.
- An exception removes the temporary file (Ctrl-C too: it is KeyboardInterrupt), and so does
  SIGTERM: while a temporary file exists, a process whose SIGTERM has its default action (die)
  removes its temporary files first, then dies of the signal as it would have. A handler of
  the program's own (or SIG_IGN) is left alone; so is a write outside the main thread, where
  Python cannot set handlers. Errors name the user's path, not the temporary one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import threading
from typing import Any, Iterator

_SUFFIX = ".tmp"
_RANDOM_CHARS = 12
_LIVE: set[str] = set()         # the temporary files this process has created and not yet renamed or removed


def target_of(path: str) -> str:
    """The file a write to `path` replaces: `path` itself, or where its symbolic links lead."""
    return os.path.realpath(path)


def name_limit(directory: str | os.PathLike) -> int:
    """The longest file name `directory`'s file system takes, in bytes (255 where it does not say)."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _temporary_name(base: str, limit: int, extension: str) -> str:
    room = limit - len(f"..{'x' * _RANDOM_CHARS}{extension}{_SUFFIX}".encode())
    short = base.encode("utf-8", "surrogateescape")[: max(room, 1)].decode("utf-8", "ignore")
    return f".{short}.{secrets.token_hex(_RANDOM_CHARS // 2)}{extension}{_SUFFIX}"


def _user_error(e: OSError, path: str) -> OSError:
    """The same OSError, naming the user's path instead of a temporary one."""
    return type(e)(e.errno, e.strerror, path)


def create_beside(path: str, extension: str = "") -> tuple[int, str]:
    """(descriptor open for writing, temporary path) of a new file beside the target of `path`.

    Refuses a target that is a directory or whose directory does not exist, naming `path`."""
    target = target_of(path)
    if os.path.isdir(target):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    directory, base = os.path.split(target)
    limit = name_limit(directory)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(directory, _temporary_name(base, limit, extension))
        _LIVE.add(tmp)                  # before it exists: a SIGTERM on the way out of open() removes it too
        _remove_on_sigterm()
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            _forget(tmp)
            continue
        except OSError as e:
            _forget(tmp)
            raise _user_error(e, path) from None
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", path)


def remove(tmp: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    _forget(tmp)


def rename_over(tmp: str, path: str) -> None:
    """Rename the temporary file onto the target of `path`."""
    try:
        os.replace(tmp, target_of(path))
    except OSError as e:
        raise _user_error(e, path) from None
    _forget(tmp)


def _on_sigterm(signum: int, frame: Any) -> None:
    """Remove the live temporary files, then die of SIGTERM as the default action would."""
    for tmp in list(_LIVE):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _remove_on_sigterm() -> None:
    """Install `_on_sigterm` where SIGTERM has its default action and Python can set handlers."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _forget(tmp: str) -> None:
    """`tmp` is gone (renamed or removed): the default SIGTERM action returns with the last one."""
    _LIVE.discard(tmp)
    if not _LIVE and threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def replacing(path: str) -> Iterator[str]:
    """A temporary path to write (keeping the target's extension, for libraries that look at it);
    renamed onto the target of `path` when the block ends, removed when it raises."""
    fd, tmp = create_beside(path, os.path.splitext(path)[1])
    mode = os.fstat(fd).st_mode & 0o777         # 0666 less the umask, as the kernel applied it
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, mode)                     # a library may have replaced the file (safetensors does)
        rename_over(tmp, path)
    finally:
        remove(tmp)
