"""In-process fake serving engines for the `kdtree validate --server` tests.

SGLang's native ``/generate`` (+ ``/get_model_info``) and the OpenAI-compatible
``/v1/completions`` (+ ``/v1/models``), on 127.0.0.1 at an ephemeral port, backed by the
built-in engine. Requests that arrive together are decoded as one batch, as a serving
engine batches them: greedy ones by AR, or (speculative=True, float32) by DDTree with a
LayerSkip drafter, sampled ones by AR sampling; log-probs come from a
teacher-forced forward of what was served (SGLang: of logits / T, what it sampled from;
OpenAI: of the raw logits, as vLLM reports them).

    engine = Engine(path, "float32")                   # a fixture's weights, loaded once
    with FakeServer(engine, "sglang") as server:       # or bug="leaky_batch", ...
        server.url

`metrics` publishes Prometheus' /metrics as an engine does: "vllm" (the spec-decode counters
vLLM registers when speculative decoding is configured) or "sglang" (its verify-call counter),
counting the DDTree rounds the server really ran: zero when it is not speculative, as a server
configured to speculate that never drafts. None: no /metrics page (404).

`ids` (OpenAI only) is how a reply carries its tokens: "token_ids" (vLLM's
return_token_ids), "names" (vLLM's --return-tokens-as-token-ids: log-prob entries named
token_id:<id>; ids only with log-probs) or "text" (SGLang's OpenAI endpoint: the exported
tokenizer's words).

Bugs, each a way serving engines have gone wrong (`BUGS`).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import torch

import kdtr_format
from kdtr_format import DDTreeConfig, ModelConfig

BUGS = {
    "accept_off_by_one": "at the first round whose draft is rejected, commits the rejected draft token, not the "
                         "target's",
    "leaky_batch": "in a batch of two or more, each request after the first also sees its neighbour's last "
                   "prompt token",
    "logprob_of_runner_up": "reports the log-prob of the runner-up token under the served token's name",
    "drop_last": "a reply of max_new_tokens tokens loses its last token",
    "hot_sampler": "samples at temperature 1 whatever it is asked",
    "http_500": "answers generation requests with HTTP 500",
    "not_json": "answers generation requests with an HTML page",
    "no_ids": "answers without token ids (SGLang: no output_ids; OpenAI: a text of unknown words)",
    "hang": "answers generation requests after 30 s",
}
BUDGET = 8                   # the fake's DDTree budget: its draft tokens per round
WINDOW = 2.0                 # seconds a batch waits for more requests (it runs as soon as it is full)


@dataclass
class Job:
    tokens: list[int]
    max_new_tokens: int
    temperature: float
    seed: int
    logprobs: int | None
    tempered_logprobs: bool                  # report log-probs of logits / T (SGLang)
    done: Future = field(default_factory=Future)


@dataclass
class Output:
    tokens: list[int]
    logprobs: list[tuple[int, float]] | None
    top: list[list[tuple[int, float]]] | None


@dataclass
class Rounds:
    """The speculative rounds a fake server ran: one draft per round, BUDGET draft tokens, and the
    drafted tokens accepted, by position."""

    drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * BUDGET)

    def add(self, acceptance_lengths: list[int]) -> None:
        for a in acceptance_lengths:               # a: the root and a - 1 accepted drafts
            self.drafts += 1
            for position in range(a - 1):
                self.accepted_per_position[position] += 1

    def page(self, engine: str, model: str) -> str:
        """Prometheus' text format, as vLLM or SGLang publishes these counts."""
        if engine == "sglang":
            return ("# HELP sglang:spec_verify_calls_total The number of verify calls.\n"
                    "# TYPE sglang:spec_verify_calls_total counter\n"
                    f'sglang:spec_verify_calls_total{{model_name="{model}"}} {float(self.drafts)}\n')
        labels = f'engine="0",model_name="{model}"'
        counts = {"num_drafts": self.drafts, "num_draft_tokens": BUDGET * self.drafts,
                  "num_accepted_tokens": sum(self.accepted_per_position)}
        lines = [f"# TYPE vllm:spec_decode_{name}_total counter\nvllm:spec_decode_{name}_total{{{labels}}} {float(n)}\n"
                 f"# TYPE vllm:spec_decode_{name}_created gauge\nvllm:spec_decode_{name}_created{{{labels}}} 1.7e+09"
                 for name, n in counts.items()]
        lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter")
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(n)}'
                  for i, n in enumerate(self.accepted_per_position)]
        return "\n".join(lines) + "\n"


class Engine:
    """A fixture's model (float32 weights, or its bf16 cases' in bf16) in the built-in engine."""

    def __init__(self, path: Path, dtype: str = "float32") -> None:
        from engine.model import Transformer

        with kdtr_format.open(path) as reader:
            self.cfg = ModelConfig.from_dict(reader.metadata["config"])
            prefix = "bf16/weights/" if dtype == "bfloat16" else "weights/"
            self.weights = {n[len(prefix):]: torch.from_numpy(np.array(reader[n], dtype=np.float32))
                            for n in reader.names(prefix)}
        self.dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.model = Transformer(self.cfg, self.weights, dtype=self.dtype)
        self.name = Path(path).stem
        self.lock = threading.Lock()

    def run(self, jobs: list[Job], bug: str | None, speculative: bool, rounds: Rounds) -> list[Output]:
        """One batch: the tokens of every job, then their log-probs; its speculative rounds added to `rounds`."""
        with self.lock:
            greedy = [j for j in jobs if j.temperature == 0]
            outputs: dict[int, list[int]] = {}
            if greedy:
                for job, tokens in zip(greedy, self._greedy(greedy, bug, speculative, rounds)):
                    outputs[id(job)] = tokens
            for temperature in sorted({j.temperature for j in jobs} - {0.0}):
                batch = [j for j in jobs if j.temperature == temperature]
                for job, tokens in zip(batch, self._sampled(batch, 1.0 if bug == "hot_sampler" else temperature)):
                    outputs[id(job)] = tokens
            served = [outputs[id(j)][:-1] if bug == "drop_last" and len(outputs[id(j)]) == j.max_new_tokens
                      else outputs[id(j)] for j in jobs]
            asked = [(j, tokens) for j, tokens in zip(jobs, served) if j.logprobs is not None and tokens]
            logits = self._teacher_forced([j.tokens + tokens[:-1] for j, tokens in asked]) if asked else []
            rows = {id(j): z[len(j.tokens) - 1:len(j.tokens) - 1 + len(tokens)] for (j, tokens), z in zip(asked, logits)}
            return [self._output(j, tokens, rows.get(id(j)), bug) for j, tokens in zip(jobs, served)]

    def _greedy(self, jobs: list[Job], bug: str | None, speculative: bool, rounds: Rounds) -> list[list[int]]:
        from engine.decode import ar_decode, ddtree_decode
        from engine.drafters import LayerSkipDrafter

        prompts = [j.tokens for j in jobs]
        if bug == "leaky_batch" and len(prompts) > 1:
            prompts = [prompts[0]] + [prompts[i - 1][-1:] + prompts[i] for i in range(1, len(prompts))]
        limits = [j.max_new_tokens for j in jobs]
        if not speculative:
            return ar_decode(self.model, prompts, limits).tokens
        drafter = LayerSkipDrafter(self.cfg, self.weights, 2)
        stages = _AcceptOffByOne() if bug == "accept_off_by_one" else None
        result = ddtree_decode(self.model, drafter, prompts, DDTreeConfig(block_size=4, budget=BUDGET), limits,
                               stages=stages)
        rounds.add(result.metrics.acceptance_lengths)
        return result.tokens

    def _sampled(self, jobs: list[Job], temperature: float) -> list[list[int]]:
        from engine.decode import ar_decode

        generator = torch.Generator().manual_seed(jobs[0].seed)
        return ar_decode(self.model, [j.tokens for j in jobs], [j.max_new_tokens for j in jobs],
                         temperature=temperature, generator=generator).tokens

    def _teacher_forced(self, sequences: list[list[int]]) -> torch.Tensor:
        """The logits [B, n, V] of each sequence's positions, one causal forward for all."""
        n = max(map(len, sequences))
        tokens = torch.zeros(len(sequences), n, dtype=torch.int64)
        for b, sequence in enumerate(sequences):
            tokens[b, :len(sequence)] = torch.tensor(sequence)
        causal = torch.ones(n, n, dtype=torch.bool).tril().expand(len(sequences), n, n)
        return self.model.forward(tokens, torch.arange(n).expand(len(sequences), n), causal,
                                  torch.tensor([len(s) for s in sequences]), torch.zeros(len(sequences), dtype=torch.int64),
                                  self.model.new_cache(len(sequences), n))

    def _output(self, job: Job, tokens: list[int], logits: torch.Tensor | None, bug: str | None) -> Output:
        """The job's reply; logits [len(tokens), V]: those behind each served token (log-probs asked)."""
        if logits is None:
            return Output(tokens, None, None)
        scale = job.temperature if job.tempered_logprobs and job.temperature > 0 else 1.0
        lp = torch.log_softmax(logits.double() / scale, dim=-1)
        entries = []
        for j, token in enumerate(tokens):
            value = lp[j, token]
            if bug == "logprob_of_runner_up":
                value = lp[j].clone().index_fill_(0, torch.tensor([token]), -torch.inf).max()
            entries.append((token, float(value)))
        top = [[(int(t), float(v)) for v, t in zip(*lp[j].topk(job.logprobs))] for j in range(len(tokens))]
        return Output(tokens, entries, top)


class _AcceptOffByOne:
    """The torch stages with the accept walk's bug (BUGS["accept_off_by_one"])."""

    def __init__(self) -> None:
        from engine.stages import TorchStages

        self.stages, self.fired = TorchStages(), set()

    def __getattr__(self, name: str):
        return getattr(self.stages, name)

    def accept(self, trees, choices):
        accepted, accept_len, next_root = self.stages.accept(trees, choices)
        real = trees.real()
        for b in range(len(next_root)):
            last = accepted[b, accept_len[b] - 1]
            drafts = ((trees.parents[b] == last) & real[b]).nonzero().flatten()
            if b not in self.fired and len(drafts) and not (trees.tokens[b, drafts] == next_root[b]).any():
                next_root[b] = trees.tokens[b, drafts[0]]
                self.fired.add(b)
        return accepted, accept_len, next_root


class _Batcher:
    """Up to `size` jobs that arrive within WINDOW of the first are run as one batch."""

    def __init__(self, engine: Engine, bug: str | None, size: int, speculative: bool) -> None:
        self.engine, self.bug, self.size, self.speculative = engine, bug, size, speculative
        self.rounds = Rounds()
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Output:
        self.jobs.put(job)
        return job.done.result()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def _work(self) -> None:
        while (first := self.jobs.get()) is not None:
            batch, deadline = [first], time.monotonic() + WINDOW
            while len(batch) < self.size and (left := deadline - time.monotonic()) > 0:
                try:
                    job = self.jobs.get(timeout=left)
                except queue.Empty:
                    break
                if job is None:
                    self.jobs.put(None)
                    break
                batch.append(job)
            try:
                for job, output in zip(batch, self.engine.run(batch, self.bug, self.speculative, self.rounds)):
                    job.done.set_result(output)
            except Exception as exc:            # the handler answers 500 with it
                for job in batch:
                    job.done.set_exception(exc)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128          # the listen backlog: many requests at once, as a serving engine takes them


class FakeServer:
    """An HTTP server on 127.0.0.1 answering as `api` ("sglang" or "openai"); `batch`: the requests
    it batches together (those the client sends at once); speculative: greedy requests by DDTree."""

    def __init__(self, engine: Engine, api: str, bug: str | None = None, ids: str = "token_ids",
                 batch: int = 1, speculative: bool = False, metrics: str | None = None) -> None:
        assert api in ("sglang", "openai") and (bug is None or bug in BUGS) and ids in ("token_ids", "names", "text")
        assert metrics in (None, "vllm", "sglang")
        assert not speculative or engine.dtype == torch.float32, "DDTree greedy equals AR in float32"
        self.engine, self.api, self.bug, self.ids, self.metrics = engine, api, bug, ids, metrics
        self.batcher = _Batcher(engine, bug, batch, speculative or bug == "accept_off_by_one")
        self.http = _HTTPServer(("127.0.0.1", 0), _Handler)
        self.http.fake = self                                   # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.batcher.stop()

    def generate(self, body: dict) -> tuple[int, bytes]:
        """A generation request's (status, reply body)."""
        if self.bug == "http_500":
            return 500, json.dumps({"object": "error", "type": "InternalServerError", "code": 500,
                                    "message": "CUDA error: an illegal memory access was encountered\n"
                                               "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."}).encode()
        if self.bug == "not_json":
            return 200, b"<html><body>502 Bad Gateway</body></html>"
        if self.bug == "hang":
            time.sleep(30)
        if self.api == "sglang":
            return 200, json.dumps(self._sglang(body)).encode()
        return 200, json.dumps(self._openai(body)).encode()

    def _sglang(self, body: dict) -> dict:
        params = body["sampling_params"]
        asked = body.get("top_logprobs_num", 0) if body.get("return_logprob") else None
        out = self.batcher.submit(Job(list(body["input_ids"]), params["max_new_tokens"], params["temperature"],
                                      params.get("sampling_seed", 0), asked, tempered_logprobs=True))
        meta = {"finish_reason": {"type": "length", "length": len(out.tokens)}, "completion_tokens": len(out.tokens)}
        if out.logprobs is not None:
            meta["output_token_logprobs"] = [[v, t, None] for t, v in out.logprobs]
            meta["output_top_logprobs"] = [[[v, t, None] for t, v in row] for row in out.top] if asked else []
        reply = {"text": " ".join(f"t{t}" for t in out.tokens), "meta_info": meta}
        if self.bug != "no_ids":
            reply["output_ids"] = out.tokens
        return reply

    def _openai(self, body: dict) -> dict:
        asked = body.get("logprobs")
        out = self.batcher.submit(Job(list(body["prompt"]), body["max_tokens"], body["temperature"],
                                      body.get("seed", 0), asked, tempered_logprobs=False))
        name = (lambda t: f"token_id:{t}") if self.ids == "names" else (lambda t: f"t{t}")
        choice = {"index": 0, "text": " ".join(f"t{t}" for t in out.tokens), "finish_reason": "length",
                  "logprobs": None}
        if self.bug == "no_ids":
            choice["text"] = "hello world"
        elif self.ids == "token_ids" and body.get("return_token_ids"):
            choice["token_ids"] = out.tokens
        if out.logprobs is not None:
            choice["logprobs"] = {"tokens": [name(t) for t, _ in out.logprobs],
                                  "token_logprobs": [v for _, v in out.logprobs],
                                  "top_logprobs": [{name(t): v for t, v in row} for row in out.top] if asked else None,
                                  "text_offset": list(range(len(out.tokens)))}
        return {"id": "cmpl-fake", "object": "text_completion", "model": self.engine.name, "choices": [choice],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(out.tokens)}}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        fake: FakeServer = self.server.fake                     # type: ignore[attr-defined]
        if fake.api == "sglang" and self.path == "/get_model_info":
            return self._reply(200, json.dumps({"model_path": f"/models/{fake.engine.name}"}).encode())
        if fake.api == "openai" and self.path == "/v1/models":
            return self._reply(200, json.dumps({"object": "list", "data": [{"id": fake.engine.name}]}).encode())
        if fake.metrics is not None and self.path == "/metrics":
            page = fake.batcher.rounds.page(fake.metrics, fake.engine.name)
            return self._reply(200, page.encode(), "text/plain; version=0.0.4")
        self._reply(404, b'{"detail": "Not Found"}')

    def do_POST(self) -> None:
        fake: FakeServer = self.server.fake                     # type: ignore[attr-defined]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != {"sglang": "/generate", "openai": "/v1/completions"}[fake.api]:
            return self._reply(404, b'{"detail": "Not Found"}')
        try:
            status, reply = fake.generate(body)
        except Exception as exc:
            status, reply = 500, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        try:
            self._reply(status, reply)
        except (BrokenPipeError, ConnectionResetError):           # the client gave up (a timeout)
            pass
