"""One bounded HTTP exchange with a server (the standard library's http.client), for clients that
must survive a hostile or broken one.

    body = exchange("http://127.0.0.1:30000", "POST", "/generate", timeout=60.0, body=b"{...}")
    reply = parse_json(body, "POST /generate")

- `timeout` bounds the whole exchange (connecting, the headers, the body), not each socket read:
  at the deadline the socket is shut, so a server that trickles a byte at a time is cut off.
- No redirect is followed: a 3xx is a `ServerError` naming the status and its Location, never
  its body (a redirect could send the request, and what it fetches, to another host).
- A reply's body is at most MAX_REPLY_BYTES: one that states a longer Content-Length is refused
  unread, one that runs past the limit (chunked, or unending) is refused when it does.
- An error status (4xx, 5xx) is an `HttpStatusError` with the status and the body's message.
- `parse_json` refuses JSON nested deeper than MAX_DEPTH (an API reply is a few levels deep),
  and what the parser cannot nest.

Every failure is a `ServerError` whose message is one line of at most MESSAGE characters: what a
server says is quoted in excerpts of at most EXCERPT characters.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import urllib.parse
from typing import Any

MAX_REPLY_BYTES = 16 * 2**20       # a reply's body; a greedy reply with top-20 log-probs is ~100 bytes a token
ERROR_BODY_BYTES = 2**16           # read of an error reply's body, for its message
MAX_DEPTH = 32                     # JSON nesting of a reply (the APIs' replies nest 5 levels)
EXCERPT = 120                      # characters of a server's text quoted in an error
MESSAGE = 400                      # characters of an error's whole message


class ServerError(Exception):
    """A server that gave no usable reply; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(_line(message, MESSAGE))


class HttpStatusError(ServerError):
    """A reply with an error status (4xx, 5xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def exchange(url: str, method: str, path: str, timeout: float, body: bytes | None = None,
             accept: str = "application/json") -> bytes:
    """`method` `path` (under the URL's path) at `url` (http(s)://host[:port][/prefix]) -> the body of
    a 2xx reply, within `timeout` seconds in all (module docstring). ServerError otherwise."""
    parts = urllib.parse.urlsplit(url)
    target = parts.path.rstrip("/") + path
    what = f"{method} {target}"                  # the path sent, the URL's prefix included
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout)
    expired = threading.Event()

    def expire() -> None:                # wakes a read blocked on the socket: it sees the end of the stream
        expired.set()
        if connection.sock is not None:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    late = ServerError(f"{what}: no whole reply within {timeout:g} s (--timeout bounds the whole reply)")
    headers = {"Accept": accept} | ({"Content-Type": "application/json"} if body is not None else {})
    try:
        connection.request(method, target, body=body, headers=headers)
        response = connection.getresponse()
        status, reason = response.status, _line(response.reason, EXCERPT)
        if 300 <= status < 400:
            location = response.getheader("Location")
            raise ServerError(f"{what}: HTTP {status} {reason}, a redirect to "
                              f"{_line(location, EXCERPT) if location else 'nowhere (no Location)'}: not followed "
                              "(give --server the URL that answers)")
        raw = _read(response, what, status < 400)
    except ServerError:
        raise
    except (http.client.HTTPException, OSError, ValueError) as exc:
        raise late if expired.is_set() else ServerError(f"{what}: {_reason(exc, url, timeout)}") from None
    finally:
        timer.cancel()
        connection.close()
    if expired.is_set():
        raise late
    if status >= 400:
        raise HttpStatusError(status, f"{what}: HTTP {status} {reason}{_message(raw)}")
    if not 200 <= status < 300:
        raise ServerError(f"{what}: HTTP {status} {reason}: expected 200")
    return raw


def parse_json(raw: bytes, what: str) -> Any:
    """A reply's body as JSON; ServerError for one that is not JSON or nests deeper than MAX_DEPTH."""
    deep = ServerError(f"{what}: the reply nests JSON deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise deep from None
    except (UnicodeDecodeError, ValueError):
        raise ServerError(f"{what}: the reply is not JSON ({excerpt(raw)})") from None
    level = [value]
    for _ in range(MAX_DEPTH):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return value
    raise deep


def excerpt(value: Any) -> str:
    """A value or a body as one short line (at most EXCERPT characters)."""
    if isinstance(value, bytes):
        value = value[:4 * EXCERPT].decode("utf-8", "replace")
    elif not isinstance(value, str):
        try:
            value = json.dumps(value, default=str)
        except (RecursionError, ValueError):
            value = repr(type(value))
    return _line(value, EXCERPT)


def _line(text: str, limit: int) -> str:
    line = " ".join(text[:4 * limit].split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _read(response: http.client.HTTPResponse, what: str, ok: bool) -> bytes:
    """The body, at most MAX_REPLY_BYTES (ok: a 2xx or 3xx reply) or ERROR_BODY_BYTES of an error's."""
    limit = MAX_REPLY_BYTES if ok else ERROR_BODY_BYTES
    too_long = ServerError(f"{what}: the reply is longer than {MAX_REPLY_BYTES // 2**20} MiB (kdtree's limit on "
                           "a reply)")
    stated = response.getheader("Content-Length")
    if ok and stated is not None and stated.strip().isdigit() and int(stated) > limit:
        raise too_long
    chunks, size = [], 0
    while size <= limit:
        chunk = response.read(min(2**16, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
    if ok:
        raise too_long
    return b"".join(chunks)[:limit]


def _message(raw: bytes) -> str:
    """An error reply's message (a JSON body's message, detail or error), else its first characters."""
    try:
        body = parse_json(raw, "")
    except ServerError:
        body = None
    if isinstance(body, dict):
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        message = inner.get("message") or body.get("detail") or body.get("error")
        if message:
            return f": {excerpt(message)}"
    return f": {excerpt(raw)}" if raw else ""


def _reason(exc: BaseException, url: str, timeout: float) -> str:
    """Why an exchange broke, in words."""
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused (is a server listening at {url}?)"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"no whole reply within {timeout:g} s (--timeout bounds the whole reply)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host of {url} ({exc.strerror or exc})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({excerpt(str(exc))})"
    if isinstance(exc, (http.client.HTTPException, ConnectionError)):
        return f"the connection broke before a whole reply ({type(exc).__name__}: {excerpt(str(exc))})"
    return f"{type(exc).__name__}: {excerpt(str(exc))}"
