"""HTTP clients of two serving APIs, token ids in and token ids out (the standard library only).

    c = client("sglang", "http://127.0.0.1:30000", timeout=60.0)
    c.describe()                                   # who answers, in one line
    reply = c.generate(Ask(tokens=(5, 17, 200), max_new_tokens=16))
    reply.tokens, reply.logprobs, reply.top_logprobs

- sglang: POST /generate {"input_ids": [...], "sampling_params": {"max_new_tokens",
  "temperature", "top_p": 1, "top_k": -1, "ignore_eos": true[, "sampling_seed"]}[,
  "return_logprob": true, "top_logprobs_num": k, "logprob_start_len": -1]} ->
  {"output_ids": [...], "meta_info": {"output_token_logprobs": [[logprob, id, text], ...],
  "output_top_logprobs": [[[logprob, id, text], ...], ...], "finish_reason": {"type": ...}}}.
  describe: GET /get_model_info.
- openai: GET /v1/models (the first model's id goes with every request); POST /v1/completions
  {"model", "prompt": [ids], "max_tokens", "temperature", "top_p": 1, "n": 1, "stream": false,
  "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true[, "seed"][,
  "logprobs": k]} -> choices[0]: the served ids from "token_ids" (vLLM's return_token_ids), else
  from the log-prob entries' "token_id:<id>" (vLLM's return_tokens_as_token_ids), else from the
  text through a word-level vocabulary (`words`: a `refgen export`'s tokenizer; SGLang's
  OpenAI endpoint returns text only); log-probs from "logprobs": {"tokens", "token_logprobs",
  "top_logprobs"}, each entry's token read the same way.

ignore_eos: a server stops at its end-of-sequence token otherwise, and the fixture's tokens
run to max_new_tokens whatever they are. vLLM and SGLang ignore parameters they do not know.

Every failure is a `ServerError` with a one-line message: a refused connection, no whole reply
within the timeout, a redirect (never followed), an HTTP error status (with its message), a
reply longer than transport.MAX_REPLY_BYTES, nested too deep, not JSON, or lacking what the API
returns, a top-logprobs row of more than k + 1 entries (k and the served token's). Every exchange
goes through transport.py; what a server says is quoted in bounded excerpts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .transport import ServerError, exchange, parse_json
from .transport import excerpt as _excerpt

APIS = ("openai", "sglang")
TOKEN_ID = re.compile(r"token_id:(\d+)")


@dataclass(frozen=True)
class Ask:
    """One generation request. logprobs: None asks for none, 0 for the served token's, k also for
    the k most likely at each position."""

    tokens: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int | None = None


@dataclass(frozen=True)
class Reply:
    """What a server served: its tokens; with log-probs asked, per served token the token its
    entry names (None where the entry names none the client can read) and the log-prob, and the
    top-k maps token -> log-prob; the finish reason as the server names it."""

    tokens: list[int]
    logprobs: list[tuple[int | None, float]] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None


class Client:
    """One server's API (module docstring). words: a word-level vocabulary (word -> token id)
    that turns a reply's text into ids where the reply carries none."""

    api = ""

    def __init__(self, url: str, timeout: float, words: Mapping[str, int] | None = None) -> None:
        self.url, self.timeout, self.words = url.rstrip("/"), timeout, words

    def describe(self) -> str:
        """Who answers (the served model), one line; ServerError when nobody does."""
        raise NotImplementedError

    def generate(self, ask: Ask) -> Reply:
        raise NotImplementedError

    def fetch(self, path: str, accept: str = "text/plain") -> bytes:
        """GET `path` -> the body, within transport.py's bounds; HttpStatusError (its .status) for an
        error status, ServerError for anything else that went wrong."""
        return exchange(self.url, "GET", path, self.timeout, accept=accept)

    def _call(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """GET (body None) or POST a JSON body -> the parsed JSON reply (transport.py's bounds)."""
        method = "GET" if body is None else "POST"
        raw = exchange(self.url, method, path, self.timeout, None if body is None else json.dumps(body).encode())
        return parse_json(raw, f"{method} {path}")

    def _token(self, text: Any) -> int | None:
        """A log-prob entry's token: "token_id:<id>", or a word of the vocabulary; None otherwise."""
        if not isinstance(text, str):
            return None
        match = TOKEN_ID.fullmatch(text.strip())
        if match:
            return int(match[1])
        return None if self.words is None else self.words.get(text.strip())


class SGLangClient(Client):
    api = "sglang"

    def describe(self) -> str:
        info = self._call("/get_model_info")
        if not isinstance(info, dict):
            raise ServerError(f"GET /get_model_info: malformed reply: expected an object, got {_excerpt(info)}")
        return f"SGLang, model {_excerpt(str(info.get('model_path', '?')))}"

    def generate(self, ask: Ask) -> Reply:
        params: dict[str, Any] = {"max_new_tokens": ask.max_new_tokens, "temperature": ask.temperature,
                                  "top_p": 1.0, "top_k": -1, "ignore_eos": True}
        if ask.seed is not None:
            params["sampling_seed"] = ask.seed
        body: dict[str, Any] = {"input_ids": list(ask.tokens), "sampling_params": params}
        if ask.logprobs is not None:
            body.update(return_logprob=True, top_logprobs_num=ask.logprobs, logprob_start_len=-1)
        reply = self._call("/generate", body)
        where = "POST /generate: malformed reply"
        if not isinstance(reply, dict):
            raise ServerError(f"{where}: expected an object, got {_excerpt(reply)}")
        tokens = _ids(reply.get("output_ids"), f"{where}: output_ids")
        meta = reply.get("meta_info") if isinstance(reply.get("meta_info"), dict) else {}
        finish = meta.get("finish_reason")
        finish = finish.get("type") if isinstance(finish, dict) else finish
        if ask.logprobs is None:
            return Reply(tokens, finish_reason=None if finish is None else str(finish))
        entries = _list(meta.get("output_token_logprobs"), f"{where}: meta_info.output_token_logprobs")
        logprobs = [_sglang_entry(e, f"{where}: meta_info.output_token_logprobs[{i}]") for i, e in enumerate(entries)]
        top = None
        if ask.logprobs > 0:
            rows = _list(meta.get("output_top_logprobs"), f"{where}: meta_info.output_top_logprobs")
            top = [dict(_sglang_entry(e, f"{where}: meta_info.output_top_logprobs[{i}]")
                        for e in _top_entries(row, ask.logprobs, f"{where}: meta_info.output_top_logprobs[{i}]"))
                   for i, row in enumerate(rows)]
        return Reply(tokens, logprobs, top, None if finish is None else str(finish))


class OpenAIClient(Client):
    api = "openai"

    def __init__(self, url: str, timeout: float, words: Mapping[str, int] | None = None) -> None:
        super().__init__(url, timeout, words)
        self.model: str | None = None

    def describe(self) -> str:
        listing = self._call("/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        models = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if not models or not isinstance(models[0], str):
            raise ServerError(f"GET /v1/models: malformed reply: no model id in {_excerpt(listing)}")
        self.model = models[0]
        return f"OpenAI-compatible, model {_excerpt(self.model)}"

    def generate(self, ask: Ask) -> Reply:
        if self.model is None:
            self.describe()
        body: dict[str, Any] = {"model": self.model, "prompt": list(ask.tokens), "max_tokens": ask.max_new_tokens,
                                "temperature": ask.temperature, "top_p": 1.0, "n": 1, "stream": False,
                                "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
        if ask.seed is not None:
            body["seed"] = ask.seed
        if ask.logprobs is not None:
            body["logprobs"] = ask.logprobs
        reply = self._call("/v1/completions", body)
        where = "POST /v1/completions: malformed reply"
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
            raise ServerError(f"{where}: no choices[0] in {_excerpt(reply)}")
        choice = choices[0]
        logprobs = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else None
        tokens = self._served(choice, logprobs, where)
        finish = choice.get("finish_reason")
        if ask.logprobs is None:
            return Reply(tokens, finish_reason=None if finish is None else str(finish))
        if logprobs is None:
            raise ServerError(f"{where}: log-probs asked, choices[0].logprobs is {_excerpt(choice.get('logprobs'))}")
        names = _list(logprobs.get("tokens"), f"{where}: choices[0].logprobs.tokens")
        values = _list(logprobs.get("token_logprobs"), f"{where}: choices[0].logprobs.token_logprobs")
        if len(names) != len(values):
            raise ServerError(f"{where}: {len(names)} logprobs.tokens, {len(values)} token_logprobs")
        entries = [(self._token(n), _float(v, f"{where}: token_logprobs[{i}]")) for i, (n, v) in
                   enumerate(zip(names, values))]
        top = None
        if ask.logprobs > 0:
            rows = _list(logprobs.get("top_logprobs"), f"{where}: choices[0].logprobs.top_logprobs")
            top = [self._top(row, ask.logprobs, f"{where}: top_logprobs[{i}]") for i, row in enumerate(rows)]
        return Reply(tokens, entries, top, None if finish is None else str(finish))

    def _served(self, choice: Mapping[str, Any], logprobs: Mapping[str, Any] | None, where: str) -> list[int]:
        """The served ids: token_ids, else the log-prob entries' ids, else the text's words."""
        if choice.get("token_ids") is not None:
            return _ids(choice["token_ids"], f"{where}: choices[0].token_ids")
        names = logprobs.get("tokens") if logprobs is not None else None
        if isinstance(names, list) and all(isinstance(n, str) and TOKEN_ID.fullmatch(n.strip()) for n in names):
            return [self._token(n) for n in names]                     # type: ignore[misc]
        text = choice.get("text")
        if self.words is not None and isinstance(text, str):
            ids = [self.words.get(word) for word in text.split()]
            if None not in ids:
                return ids                                              # type: ignore[return-value]
            unknown = text.split()[ids.index(None)]
            raise ServerError(f"{where}: no token_ids, and the text's word {unknown[:40]!r} is not in the exported "
                              "tokenizer's vocabulary (is the server serving the export?)")
        raise ServerError(f"{where}: choices[0] carries no token ids (vLLM: return_token_ids, from 0.10.2; "
                          "SGLang: --api sglang, or validate a `refgen export` directory, whose tokenizer reads the text)")

    def _top(self, row: Any, k: int, where: str) -> dict[int, float]:
        if not isinstance(row, dict):
            raise ServerError(f"{where}: expected an object of token -> log-prob, got {_excerpt(row)}")
        top = {}
        for name, value in _top_entries(list(row.items()), k, where):
            token = self._token(name)
            if token is None:
                raise ServerError(f"{where}: token {name[:40]!r} is no token id (token_id:<id>) nor a word of the "
                                  "exported vocabulary")
            top[token] = _float(value, f"{where}[{name[:40]!r}]")
        return top


def client(api: str, url: str, timeout: float, words: Mapping[str, int] | None = None) -> Client:
    """The client of `api` ("openai" or "sglang") at `url` (http://host:port[/prefix])."""
    classes = {"openai": OpenAIClient, "sglang": SGLangClient}
    if api not in classes:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    return classes[api](url, timeout, words)


# ---------------------------------------------------------------------------- reading replies

def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise ServerError(f"{what}: expected a list, got {_excerpt(value)}")
    return value


def _ids(value: Any, what: str) -> list[int]:
    items = _list(value, what)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        raise ServerError(f"{what}: expected token ids (integers >= 0), got {_excerpt(items)}")
    return list(items)


def _float(value: Any, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ServerError(f"{what}: expected a log-prob, got {_excerpt(value)}")
    return float(value)


def _top_entries(row: Any, k: int, what: str) -> list:
    """A position's top-k entries: at most k + 1 (the k most likely, and the served token's where it is
    not among them, as vLLM adds it)."""
    entries = _list(row, what)
    if len(entries) > k + 1:
        raise ServerError(f"{what}: {len(entries)} top-logprob entries, {k} asked")
    return entries


def _sglang_entry(entry: Any, what: str) -> tuple[int, float]:
    """[logprob, token_id, text] -> (token_id, logprob)."""
    if not (isinstance(entry, (list, tuple)) and len(entry) >= 2):
        raise ServerError(f"{what}: expected [logprob, token_id, text], got {_excerpt(entry)}")
    (token,) = _ids([entry[1]], what)
    return token, _float(entry[0], what)

