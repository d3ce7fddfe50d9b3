"""What `kdtr inspect` prints: the tensor table (or a summary by prefix) and the metadata, as plain text.

Plain text, not a rich table: names and metadata are printed verbatim (no markup is interpreted,
nothing is cut), a name that holds characters a terminal would act on (control characters, lone
surrogates, other non-printables) is printed as a Python string literal (`clikit.shown`), and 200,000 rows take a
fraction of a second. Piped, the table has one line per tensor (for grep and awk), the name last.
On a terminal narrower than that table each tensor takes two lines instead: its name, then the
other columns indented, so only a name longer than the terminal wraps.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .clikit import shown
from .reader import Reader, TensorInfo

LIST_AT_MOST = 1000          # more tensors than this are summarized by prefix unless --all
_NOT_ASCII_PRINTABLE = re.compile(r"[^\x20-\x7e\n]+")


def columns(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    """Rows of cells as lines, each column padded to its widest cell (right-aligned where asked), the
    last column unpadded."""
    widths = [max(map(len, column)) for column in list(zip(*rows))[:-1]]
    line = "  ".join([*(f"{{:{'>' if k in right else '<'}{w}}}" for k, w in enumerate(widths)), "{}"])
    return [line.format(*row) for row in rows]


@dataclass(frozen=True)
class Group:
    prefix: str
    tensors: int
    nbytes: int


def groups(infos: list[TensorInfo], prefix: str) -> list[Group]:
    """The tensors under `prefix` grouped by their next path component (`prefix` + up to and including a '/')."""
    found: dict[str, list[int]] = {}
    for info in infos:
        rest = info.name[len(prefix) :]
        cut = rest.find("/")
        entry = found.setdefault(prefix + (rest if cut < 0 else rest[: cut + 1]), [0, 0])
        entry[0] += 1
        entry[1] += info.nbytes
    return [Group(key, count, nbytes) for key, (count, nbytes) in found.items()]


def tensor_table(infos: list[TensorInfo], width: int | None) -> list[str]:
    """One line per tensor; two (name, then the rest indented) when a line would pass `width`."""
    rows = [("dtype", "shape", "nbytes", "offset", "crc32c", "name")]
    rows += [(i.dtype, str(list(i.shape)), str(i.nbytes), str(i.offset), f"{i.crc32c:08x}", shown(i.name)) for i in infos]
    lines = columns(rows, right={2, 3})
    if width is None or max(map(len, lines)) <= width:
        return lines
    fields = columns([(*row[:-1], "") for row in rows], right={2, 3})
    return [f"name\n    {fields[0].rstrip()}"] + [f"{row[-1]}\n    {line.rstrip()}" for row, line in zip(rows[1:], fields[1:])]


def group_table(found: list[Group]) -> list[str]:
    rows = [("tensors", "nbytes", "prefix")] + [(str(g.tensors), str(g.nbytes), shown(g.prefix)) for g in found]
    return columns(rows, right={0, 1})


def listing(reader: Reader, prefix: str | None, everything: bool, width: int | None = None) -> list[str]:
    """The lines of the tensor part of `kdtr inspect`; `width` is the terminal's (None when piped)."""
    infos = [reader.info(name) for name in reader.names(prefix)]
    scope = f" under {shown(prefix)}" if prefix else ""
    lines = [f"KDTR {reader.version[0]}.{reader.version[1]}, alignment {reader.alignment}, "
             f"{len(infos)} tensors{scope}, {sum(i.nbytes for i in infos)} bytes"]
    if not infos:
        return lines
    if everything or len(infos) <= LIST_AT_MOST:
        return lines + tensor_table(infos, width)
    scope = prefix or ""
    found = groups(infos, scope)
    while len(found) == 1 and found[0].prefix.endswith("/") and found[0].prefix != scope:   # one level further down
        scope = found[0].prefix
        found = groups(infos, scope)
    if len(found) <= LIST_AT_MOST:
        lines += [f"{len(infos)} tensors in {len(found)} groups by prefix",    # two lines: each fits 80 columns
                  "(--prefix PREFIX lists a group, --all every tensor):"]
        return lines + group_table(found)
    lines += tensor_table(infos[:LIST_AT_MOST], width)
    lines.append(f"... and {len(infos) - LIST_AT_MOST} more (--all lists every tensor, --prefix PREFIX those under it)")
    return lines


def _escape(char: str) -> str:
    """`char` itself when printable, else its JSON escape (a surrogate pair above U+FFFF)."""
    if char.isprintable():
        return char
    code = ord(char)
    if code > 0xFFFF:
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def metadata_text(metadata: dict) -> str:
    """The metadata as indented JSON, every character that is not printable (controls, lone
    surrogates, bidi overrides, ...) written as a JSON escape: safe on a terminal, and it parses
    back to the same value."""
    text = json.dumps(metadata, indent=2, ensure_ascii=False)
    return _NOT_ASCII_PRINTABLE.sub(lambda m: "".join(map(_escape, m.group())), text)
