"""`kdtree validate --server URL`: what a running serving engine serves, against a model fixture.

    report = validate_server(ServerRun("http://127.0.0.1:30000", api="sglang"), "/models/tiny-bf16")

The fixture: a `refgen export` directory (its kdtree-export.json names the fixture and the
regime it is judged in; its tokenizer turns a reply's text back into ids where a server
returns no ids), or a model fixture file, judged in `dtype` (float32 by default).

The run (one section of the report, named by the fixture file):

- ``server``: who answers (SGLang's /get_model_info, the OpenAI API's /v1/models); when
  nobody does, this one FAIL row is the report.
- temperature 0: every prompt of the regime's cases, as token ids, with max_new_tokens its AR
  length; with --concurrency N, ceil(N / prompts) copies of each, in flight N at a time and
  interleaved so that a batch holds different prompts: the way batching bugs show. A row
  ``tokens <prompt>`` judges every copy (served.tokens_row); ``logprobs <prompt>`` with
  --logprobs K, the served log-probs (served.logprobs_row).
- temperature T > 0: `samples` seeded runs of every prompt (seed, seed + 1, ...), each as long
  as the tested prefixes reach (served.sampling_family); ``sampling <prompt>`` tests the law of
  the served tokens (served.sampling_row), ``logprobs <prompt>`` the log-probs as above.

- ``speculation``: what the server's /metrics counted over the run (drafts, draft tokens,
  accepted), where it publishes such counters; with `require_speculation`, a FAIL when it
  publishes none or drafted or accepted nothing (rows/speculation.py).

Every request that fails (refused, timed out, an HTTP error, a malformed reply) is a FAIL in
its prompt's rows, in one line; nothing else stops the run.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import kdtr_format
from kdtr_format import KdtrError

from ...serving import Ask, Client, ServerError, client
from ...serving.speculation import Speculation
from ..fixtures import model_fixture_config
from ..judging.prefixes import KnownPrefixes
from ..judging.regime import DTYPES, CasesView, Regime
from ..reports.report import Check, Report, Status, ValidateError
from ..rows.served import MIN_REACH, Served, logprobs_row, sampling_family, sampling_row, tokens_row
from ..rows.speculation import PublishedSpeculation

MANIFEST = "kdtree-export.json"          # refgen/export.py writes it
SAMPLES = 400                            # runs per prompt at temperature > 0
DEVICE = "server"                        # a server run's Report.device; its adapter: "URL (api)"


@dataclass(frozen=True)
class ServerRun:
    """How to reach and question the server (module docstring)."""

    url: str
    api: str = "openai"
    concurrency: int = 1
    temperature: float = 0.0
    samples: int = SAMPLES
    seed: int = 0
    logprobs: int | None = None
    timeout: float = 60.0
    require_speculation: bool = False


@dataclass(frozen=True)
class ServedFixture:
    """The model fixture a run judges against, its regime's dtype and (an export's) vocabulary."""

    path: Path
    dtype: str
    words: dict[str, int] | None


def served_fixture(fixtures: str | os.PathLike | None, dtype: str | None) -> ServedFixture:
    """The fixture of `--fixtures` (module docstring); `dtype` None: the export's regime, else float32.
    ValidateError for anything that is not one model fixture."""
    if fixtures is None:
        raise ValidateError("--server needs --fixtures: a `refgen export` directory, or the model fixture file "
                            "of the model the server serves")
    path = Path(fixtures)
    directory = path if path.is_dir() else path.parent
    manifest = _manifest(directory)
    if path.is_dir():
        if manifest is None:
            files = sorted(p.name for p in path.glob("*.kdtr"))
            if len(files) != 1:
                raise ValidateError(f"{path}: --server checks one model: give --fixtures a model fixture file "
                                    f"(this directory holds {', '.join(files) or 'no .kdtr file'})")
            path = path / files[0]
        elif manifest.get("fixture") is None:
            raise ValidateError(f"{path}: a draft model's export (refgen export --layers): validate the target's "
                                "export, with this one as its draft")
        else:
            path = path / str(manifest["fixture"])
    if not path.is_file():
        raise ValidateError(f"{path}: no such fixture file")
    if path.suffix != ".kdtr":
        raise ValidateError(f"{path}: not a .kdtr fixture file")
    exported = manifest is not None and manifest.get("fixture") == path.name
    regime = str(manifest["regime"]) if exported else "float32"
    if dtype is not None and exported and dtype != regime:
        raise ValidateError(f"--dtype {dtype}: the export in {directory} is judged as {regime} (its weights are "
                            f"{manifest['dtype']}); leave --dtype out")
    dtype = dtype or regime
    if dtype not in DTYPES:
        raise ValidateError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return ServedFixture(path, dtype, _words(directory) if exported else None)


def _manifest(directory: Path) -> dict | None:
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValidateError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(manifest, dict) or "fixture" not in manifest or "regime" not in manifest:
        raise ValidateError(f"{path}: not a refgen export manifest (no fixture and regime)")
    return manifest


def _words(directory: Path) -> dict[str, int] | None:
    """The exported tokenizer's word-level vocabulary (word -> id), None when there is none."""
    try:
        vocab = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    return vocab if isinstance(vocab, dict) else None


def validate_server(run: ServerRun, fixtures: str | os.PathLike | None, dtype: str | None = None,
                    log: Callable[[str], None] = lambda line: None, server: Client | None = None,
                    counters: Callable[[], Speculation | None] | None = None) -> Report:
    """The report of one run (module docstring). ValidateError for fixtures that cannot be judged against.
    An in-process engine (engine/adapters/hf_generate.py) gives `server`, the client to question instead
    of `run.api`'s at `run.url`, and `counters`, its speculation counters now, read instead of /metrics."""
    served = served_fixture(fixtures, dtype)
    if run.temperature > 0 and run.samples < MIN_REACH:
        raise ValidateError(f"--samples {run.samples}: a sampled run needs at least {MIN_REACH:g} runs a prompt "
                            "(the first token's law is tested from them)")
    report = Report(implementation=f"server {run.url} ({run.api} API)", device=DEVICE, fixtures=str(served.path),
                    adapter=f"{run.url} ({run.api})")
    try:
        with kdtr_format.open(served.path) as reader:
            if reader.metadata.get("kind") != "model":
                raise ValidateError(f"{served.path}: not a model fixture (kind {reader.metadata.get('kind')!r}); a "
                                    "server serves a model")
            regime = Regime.of(reader.metadata, served.dtype)
            if regime is None:
                raise ValidateError(f"{served.path}: holds no {served.dtype} cases (regenerate it with `refgen generate`)")
            cfg = model_fixture_config(reader, served.path)
            view = CasesView(reader, regime)
            known = {p["name"]: KnownPrefixes(view, cfg, p["name"]) for p in regime.metadata["prompts"]}
            asked = server or client(run.api, run.url, run.timeout, served.words)
            report.checks = _rows(run, asked, served.path.name, known, regime, cfg.vocab_size, log, counters)
    except KdtrError as exc:
        raise ValidateError(f"{served.path}: {exc}") from None
    return report


def _rows(run: ServerRun, server: Client, section: str, known: Mapping[str, KnownPrefixes], regime: Regime,
          vocab: int, log: Callable[[str], None], read: Callable[[], Speculation | None] | None) -> list[Check]:
    log(f"asking {run.url} who answers")
    try:
        who = server.describe()
    except ServerError as exc:
        return [Check(section, "server", Status.FAIL, detail=str(exc))]
    rows = [Check(section, "server", Status.EXACT, detail=f"{who}; {regime.short} cases")]
    counters = PublishedSpeculation(run.url, run.timeout, read)
    if run.temperature == 0:
        copies = max(1, math.ceil(run.concurrency / len(known)))
        asks = [(name, Ask(tuple(k.prompt_tokens.tolist()), len(k.ar_tokens), logprobs=run.logprobs))
                for _ in range(copies) for name, k in known.items()]
        log(f"{len(asks)} greedy request(s), {run.concurrency} at a time")
        replies = _send(server, [ask for _, ask in asks], run.concurrency)
        for name, k in known.items():
            mine = [s for (n, _), s in zip(asks, replies) if n == name]
            rows.append(tokens_row(section, f"tokens {name}", mine, k, regime, vocab))
            if run.logprobs is not None:
                rows.append(logprobs_row(section, f"logprobs {name}", mine, k, regime, 0.0, run.logprobs))
        return rows + counters.rows(section, run.require_speculation)
    families = {name: sampling_family(k, run.temperature, run.samples) for name, k in known.items()}
    tests = sum(len(f) for f in families.values())
    asks = []
    for name, k in known.items():
        length = max(len(p) for p in families[name]) + 1 if families[name] else 1
        first = run.seed + len(asks)                   # every run of the whole run its own seed
        asks += [(name, Ask(tuple(k.prompt_tokens.tolist()), length, run.temperature, first + i, run.logprobs))
                 for i in range(run.samples)]
    log(f"{len(asks)} sampled runs at temperature {run.temperature:g}, {run.concurrency} at a time; "
        f"{tests} prefixes to test")
    replies = _send(server, [ask for _, ask in asks], run.concurrency)
    for name, k in known.items():
        mine = [(ask, s) for (n, ask), s in zip(asks, replies) if n == name]
        rows.append(sampling_row(section, f"sampling {name}", [s for _, s in mine], k, families[name], max(tests, 1),
                                 run.temperature, mine[0][0].max_new_tokens))
        if run.logprobs is not None:
            rows.append(logprobs_row(section, f"logprobs {name}", [s for _, s in mine], k, regime, run.temperature,
                                     run.logprobs))
    return rows + counters.rows(section, run.require_speculation)


def _send(server: Client, asks: list[Ask], concurrency: int) -> list[Served]:
    """Every ask, `concurrency` in flight at a time, in order; a failed one as its error."""
    def one(ask: Ask) -> Served:
        try:
            reply = server.generate(ask)
        except ServerError as exc:
            return Served([], error=str(exc))
        return Served(reply.tokens, reply.logprobs, reply.top_logprobs)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, asks))

