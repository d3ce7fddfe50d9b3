"""Scripted HTTP servers for the server door's hostile and near-the-line cases (no engine behind them).

`ScriptedServer(answer)` listens on 127.0.0.1 at an ephemeral port, records every request and lets
`answer(request, handler)` write whatever reply it likes, raw bytes included (a redirect, a body
trickled a byte at a time, an endless chunked body).

`Reference(known, api)` answers as a faithful server of either API from a model fixture's
references alone: each prompt's AR tokens, and with log-probs asked the reference's log-softmax
of the known logits and its top-k (0 and the served token where the fixture holds no logits).
`edit(request, reply)` changes the neutral reply before it is written in the API's form:

    def one_extra(request, reply):
        reply.tokens.append(reply.tokens[-1])
        reply.entries.append(reply.entries[-1])
        reply.top.append(reply.top[-1])
    with ScriptedServer(Reference(known, "sglang", edit=one_extra)) as server: ...
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

import numpy as np


@dataclass
class Request:
    method: str
    path: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class ScriptedServer:
    """An HTTP server on 127.0.0.1 whose every request is `answer(request, handler)`; `requests` lists
    them in arrival order."""

    def __init__(self, answer: Callable[[Request, BaseHTTPRequestHandler], None]) -> None:
        self.answer, self.requests, self.lock = answer, [], threading.Lock()
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.http.daemon_threads = True
        self.http.scripted = self                               # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.02,), daemon=True)  # stops in 0.02 s

    def __enter__(self) -> "ScriptedServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.shutdown()
        self.http.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _serve(self) -> None:
        scripted: ScriptedServer = self.server.scripted         # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        request = Request(self.command, self.path, self.rfile.read(length))
        with scripted.lock:
            scripted.requests.append(request)
        try:
            scripted.answer(request, self)
        except (BrokenPipeError, ConnectionResetError):          # the client hung up
            pass
        self.close_connection = True

    do_GET = do_POST = _serve


def send(handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: Mapping[str, str] = {}) -> None:
    """A whole reply with its Content-Length."""
    handler.send_response(status)
    for name, value in {"Content-Type": "application/json", **headers}.items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@dataclass
class Neutral:
    """A reply before it takes an API's form: the served tokens, per token the (named token, log-prob)
    entry and the top-k [(token, log-prob)]; `reference`: per token the reference's log-softmax [V]
    (None where the fixture holds no logits), for edits to draw on."""

    tokens: list[int]
    entries: list[tuple[int, float]] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    reference: list[np.ndarray | None] = field(default_factory=list)


class Reference:
    """A faithful server of `api` from the references of `known` (prompt name -> KnownPrefixes), as a
    ScriptedServer's answer; `edit(request, reply)` changes each reply; `model` the name it answers with."""

    def __init__(self, known: Mapping[str, Any], api: str, edit: Callable[[Request, Neutral], None] | None = None,
                 model: str = "tiny") -> None:
        self.by_prompt = {tuple(k.prompt_tokens.tolist()): k for k in known.values()}
        self.api, self.edit, self.model = api, edit, model

    def __call__(self, request: Request, handler: BaseHTTPRequestHandler) -> None:
        if request.method == "GET":
            if request.path != {"sglang": "/get_model_info", "openai": "/v1/models"}[self.api]:
                return send(handler, 404, b'{"detail": "Not Found"}')
            info = {"model_path": self.model} if self.api == "sglang" else {"data": [{"id": self.model}]}
            return send(handler, 200, json.dumps(info).encode())
        body = request.json()
        if self.api == "sglang":
            prompt, limit = body["input_ids"], body["sampling_params"]["max_new_tokens"]
            k = body.get("top_logprobs_num", 0) if body.get("return_logprob") else None
        else:
            prompt, limit, k = body["prompt"], body["max_tokens"], body.get("logprobs")
        reply = self.reply(tuple(prompt), limit, k)
        if self.edit is not None:
            self.edit(request, reply)
        send(handler, 200, json.dumps(self._form(reply, k)).encode())

    def reply(self, prompt: tuple[int, ...], limit: int, k: int | None) -> Neutral:
        known = self.by_prompt[prompt]
        tokens = [int(t) for t in known.ar_tokens[:limit]]
        reply = Neutral(tokens)
        if k is None:
            return reply
        for j, token in enumerate(tokens):
            logits = known.logits(tuple(tokens[:j]))
            if logits is None:
                reply.entries.append((token, 0.0))
                reply.top.append([(token, 0.0)] + [((token + i) % 1024, -50.0) for i in range(1, k)])
                reply.reference.append(None)
                continue
            lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            reply.reference.append(lp)
            reply.entries.append((token, float(lp[token])))
            reply.top.append([(int(t), float(lp[t])) for t in np.argsort(lp)[::-1][:k]])
        return reply

    def _form(self, reply: Neutral, k: int | None) -> dict:
        if self.api == "sglang":
            meta: dict[str, Any] = {"finish_reason": {"type": "length"}}
            if k is not None:
                meta["output_token_logprobs"] = [[v, t, None] for t, v in reply.entries]
                meta["output_top_logprobs"] = [[[v, t, None] for t, v in row] for row in reply.top] if k else []
            return {"output_ids": reply.tokens, "meta_info": meta}
        choice: dict[str, Any] = {"index": 0, "token_ids": reply.tokens, "finish_reason": "length", "logprobs": None}
        if k is not None:
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t, _ in reply.entries],
                                  "token_logprobs": [v for _, v in reply.entries],
                                  "top_logprobs": [{f"token_id:{t}": v for t, v in row} for row in reply.top]
                                  if k else None}
        return {"choices": [choice]}
