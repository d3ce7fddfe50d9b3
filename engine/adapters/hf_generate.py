"""HF transformers' own speculative decoding, judged in-process as a served engine is.

    server = hf_generate("/models/tiny-f32", assistant="/models/tiny-draft")     # or lookup=3
    report = validate_generate("/models/tiny-f32", server)                         # greedy
    report = validate_generate("/models/tiny-f32", server, temperature=0.6, samples=200)

`HFGenerate` is a client of engine/serving's kind (describe, generate) whose "server" is
`model.generate` on a `refgen export` directory, in-process: assisted generation with a draft
export as `assistant_model` (`refgen export --layers K`), or prompt lookup
(`prompt_lookup_num_tokens`). `validate_generate` hands it to `validate_server`, so the rows
and their verdict rules are a served run's (engine/validate/rows/served.py): greedy tokens
against the fixture's AR tokens along its known prefixes, sampled runs against the law
softmax(logits / T) by chi-square and total variation, log-probs where asked.

What HF drafted and accepted is counted by wrapping the candidate generator `generate` builds
(its `update_candidate_strategy(input_ids, scores, num_matches)`, called once a round with the
target's scores over the candidates and the bonus position, and the accepted count). The run's
``speculation`` row (engine/validate/rows/speculation.py) reads them where a server's run reads
vLLM's /metrics, as required (--require-speculation): a run that drafted or accepted nothing
FAILs, since it judged AR decoding only.

Sampling: every ask's seed seeds torch's generator around its `generate` (`torch.random.fork_rng`),
so a run reproduces; `top_k` 0 and `top_p` 1 leave the law softmax(logits / T) whole (HF's
defaults would cut it to the top 50). The export's weights load in the dtype they were written
in (its regime judges them); a draft labelled DeepseekV2 (refgen export --layers, docs/serving.md)
loads as the DeepseekV3 it is, since HF's own DeepseekV2 routes with a softmax.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ..serving import Ask, Client, Reply, ServerError
from ..serving.speculation import Speculation
from ..validate.reports.report import Report, ValidateError
from ..validate.run.server import SAMPLES, ServerRun, validate_server
from .hf import transformers          # the guarded import: transformers >= TRANSFORMERS_MIN, or one ImportError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Tally:
    """What the candidate generators drafted and the target accepted, summed over rounds."""

    drafts: int = 0                   # rounds that drafted at least one token
    draft_tokens: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.drafts += drafted > 0
        self.draft_tokens += drafted
        self.accepted += accepted
        self.per_position += [0] * (accepted - len(self.per_position))
        for i in range(accepted):
            self.per_position[i] += 1

    def speculation(self) -> Speculation:
        return Speculation(f"HF transformers {transformers.__version__}", self.drafts, self.draft_tokens,
                           self.accepted, tuple(self.per_position))


def load_export(directory: str | os.PathLike) -> torch.nn.Module:
    """A `refgen export` directory (a target or a draft) as HF's DeepseekV3ForCausalLM, eager attention
    and experts, in the dtype its weights were written in. ValidateError, one line, for anything else."""
    path = Path(directory)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValidateError(f"{path}: no readable config.json ({exc})") from None
    if not isinstance(config, dict) or config.get("model_type") not in ("deepseek_v3", "deepseek_v2"):
        raise ValidateError(f"{path}: not a DeepSeek checkpoint (config.json's model_type "
                            f"{config.get('model_type') if isinstance(config, dict) else None!r})")
    dtype = DTYPES.get(str(config.get("torch_dtype")))
    if "quantization_config" in config or dtype is None:
        weights = "quantized" if "quantization_config" in config else f"torch_dtype {config.get('torch_dtype')!r}"
        raise ValidateError(f"{path}: {weights} weights: HF generate is judged in-process on {' or '.join(DTYPES)} "
                            "exports")
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    try:
        return transformers.DeepseekV3ForCausalLM.from_pretrained(
            path, config=transformers.DeepseekV3Config(**fields), dtype=dtype, attn_implementation="eager",
            experts_implementation="eager").eval()
    except (OSError, ImportError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise ValidateError(f"{path}: HF cannot load it ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") \
            from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings off (the assistant's own generate warns of its config each round)."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


class HFGenerate(Client):
    """`target.generate` on one export, assisted by `assistant` (a model) or by prompt lookup
    (`lookup` tokens a draft), as a client of a server (module docstring); `options`: more of
    generate's arguments (max_matching_ngram_size, assistant_ensemble_weight, ...; the assistant's
    num_assistant_tokens is its generation_config's). Calls run one at a time; `tally` counts every
    call's drafts."""

    api = "hf"

    def __init__(self, target: torch.nn.Module, assistant: torch.nn.Module | None = None, lookup: int | None = None,
                 options: Mapping[str, Any] | None = None, name: str = "") -> None:
        if (assistant is None) == (lookup is None):
            raise ValueError("HFGenerate: an assistant model or prompt lookup, one of them")
        if lookup is not None and lookup < 1:
            raise ValueError(f"HFGenerate: prompt lookup drafts at least 1 token, got {lookup}")
        if not callable(getattr(target, "_get_candidate_generator", None)):
            raise ValueError(f"HFGenerate: transformers {transformers.__version__}'s generate builds no candidate "
                             "generator (_get_candidate_generator) to count drafts from")
        super().__init__(f"in-process:{name}", timeout=0.0)
        self.target, self.assistant, self.lookup = target, assistant, lookup
        self.options = dict(options or {})
        self.method = f"prompt lookup ({lookup} tokens)" if lookup is not None else "assisted generation"
        self.tally = Tally()
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"HF transformers {transformers.__version__} generate in-process, {self.method}"

    def generate(self, ask: Ask) -> Reply:
        """HF drafts only where its bonus token still fits (max_new_tokens - 1 tokens at most), so it is
        asked for one token more than `ask`, and the reply holds `ask`'s: every asked position could be
        drafted, and the tally counts the asked positions only."""
        options = dict(max_new_tokens=ask.max_new_tokens + 1, do_sample=ask.temperature > 0,
                       return_dict_in_generate=True, output_logits=ask.logprobs is not None)
        if ask.temperature > 0:
            options.update(temperature=ask.temperature, top_k=0, top_p=1.0)
        if self.assistant is not None:
            options["assistant_model"] = self.assistant
        else:
            options["prompt_lookup_num_tokens"] = self.lookup
        options.update(self.options)
        prompt = torch.tensor([ask.tokens], dtype=torch.int64)
        limit = len(ask.tokens) + ask.max_new_tokens
        with self._lock, _quiet(), torch.random.fork_rng(devices=[]), torch.no_grad(), self._counted(limit):
            if ask.seed is not None:
                torch.manual_seed(ask.seed)
            try:
                out = self.target.generate(prompt, **options)
            except Exception as exc:                      # HF's code failing the request: that request's FAIL
                raise ServerError(f"HF generate: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
        tokens = out.sequences[0, prompt.shape[1]:limit].tolist()
        if ask.logprobs is None:
            return Reply(tokens, finish_reason="length")
        logprobs, top = [], []
        for token, logits in zip(tokens, out.logits):          # logits: [1, V] raw, before the temperature
            row = torch.log_softmax(logits[0].double(), dim=-1)
            logprobs.append((token, float(row[token])))
            best = torch.topk(row, ask.logprobs) if ask.logprobs > 0 else None
            top.append({} if best is None else dict(zip(best.indices.tolist(), best.values.tolist())))
        return Reply(tokens, logprobs, top if ask.logprobs > 0 else None, "length")

    @contextlib.contextmanager
    def _counted(self, limit: int) -> Iterator[None]:
        """While the block runs, every candidate generator the target builds adds each round's drafted
        and accepted tokens at sequence positions below `limit` to the tally."""
        build = self.target._get_candidate_generator
        tally = self.tally

        def counting(model: torch.nn.Module, *args, **kwargs):
            generator = build(*args, **kwargs)
            update = generator.update_candidate_strategy

            def counted(input_ids: torch.Tensor, scores: torch.Tensor, num_matches: int) -> None:
                # input_ids [1, S] with the round's tokens; scores [1, drafted + 1, V]
                room = max(0, limit - (input_ids.shape[1] - int(num_matches) - 1))
                tally.add(min(scores.shape[1] - 1, room), min(int(num_matches), room))
                update(input_ids, scores, num_matches)
            generator.update_candidate_strategy = counted
            return generator

        self.target._get_candidate_generator = types.MethodType(counting, self.target)
        try:
            yield
        finally:
            del self.target._get_candidate_generator


def hf_generate(fixtures: str | os.PathLike, assistant: str | os.PathLike | None = None, lookup: int | None = None,
                options: Mapping[str, Any] | None = None) -> HFGenerate:
    """The client of HF generate on the export `fixtures`, assisted by the export `assistant` or by
    prompt lookup of `lookup` tokens. ValidateError, one line, for exports HF cannot load."""
    if (assistant is None) == (lookup is None):
        raise ValidateError("HF speculative decoding: give an assistant export or prompt lookup, one of them")
    if lookup is not None and lookup < 1:
        raise ValidateError(f"prompt lookup: at least 1 token a draft, got {lookup}")
    with _quiet():
        target = load_export(fixtures)
        draft = None if assistant is None else load_export(assistant)
    return HFGenerate(target, draft, lookup, options, name=Path(fixtures).name)


def validate_generate(fixtures: str | os.PathLike, server: HFGenerate, temperature: float = 0.0,
                      samples: int = SAMPLES, seed: int = 0, logprobs: int | None = None,
                      log: Callable[[str], None] = lambda line: None) -> Report:
    """`server` judged against the export (or fixture file) `fixtures` as `kdtree validate --server
    --require-speculation` judges a server (module docstring), the ``speculation`` row from `server`'s
    tally. ValidateError for fixtures that cannot be judged against."""
    run = ServerRun(server.url, server.api, temperature=temperature, samples=samples, seed=seed, logprobs=logprobs,
                    require_speculation=True)
    report = validate_server(run, fixtures, log=log, server=server, counters=server.tally.speculation)
    report.implementation = server.describe()
    return report
