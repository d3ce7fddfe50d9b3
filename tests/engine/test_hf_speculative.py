"""engine/adapters/hf_generate.py: HF transformers' own speculative decoding (assisted generation with a
`refgen export --layers` draft, prompt lookup) judged in-process by a served run's rows. On tiny: greedy
equals AR and the sampled law holds, with drafts accepted; a draft accepted without verification fails the
tokens and the law, a sampler at the wrong temperature the law, and a run that accepted no draft its
speculation row."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import kdtr_format
from engine.adapters.hf_mapping import TRANSFORMERS_MIN
from engine.serving import Ask
from engine.validate.judging.prefixes import KnownPrefixes
from engine.validate.judging.regime import CasesView, Regime
from engine.validate.reports.report import Status, ValidateError
from engine.validate.rows.served import ALPHA, sampling_family
from terminal import piped

transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN,
                                   reason=f"HF transformers >= {TRANSFORMERS_MIN} is an optional outside engine "
                                          "(the test extra)")
import torch  # noqa: E402

from engine.adapters.hf_generate import HFGenerate, hf_generate, load_export, validate_generate  # noqa: E402

from packaging.version import Version  # noqa: E402

INSTALLED = Version(transformers.__version__)
# transformers' prompt lookup crops its draft at the eos token, with torch.isin(ids, None) where the model has
# none (an export has none) before 5.13 (transformers PR #46790); assistant_ensemble_weight is from 5.14.
needs_lookup = pytest.mark.skipif(INSTALLED < Version("5.13"), reason=f"transformers {INSTALLED}'s prompt lookup "
                                  "fails on a model without an eos token (fixed in 5.13)")
needs_ensemble = pytest.mark.skipif(INSTALLED < Version("5.14"), reason=f"transformers {INSTALLED} has no "
                                    "assistant_ensemble_weight (from 5.14)")
PROMPTS = ("p0", "p1", "p2")
T, RUNS, LOSSY = 0.6, 80, 50


@pytest.fixture(scope="module")
def exports(golden, tmp_path_factory):
    """tiny's float32 export and a 2-layer draft of it, as `refgen export` writes them."""
    directory = tmp_path_factory.mktemp("hf-speculative")
    for name, extra in (("tiny-f32", []), ("tiny-draft", ["--layers", "2"])):
        result = piped(["refgen", "export", str(golden / "tiny.kdtr"), "--out", str(directory / name), *extra])
        assert result.returncode == 0, result.output
    return directory / "tiny-f32", directory / "tiny-draft"


@pytest.fixture(scope="module")
def assisted(exports):
    """HF generate on the export with the draft as assistant_model, one thread (tiny's matrices are small)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield hf_generate(exports[0], assistant=exports[1])
    torch.set_num_threads(threads)


def rows_of(report) -> dict:
    return {c.name: c for c in report.checks}


def judged(exports, server, **options) -> dict:
    return rows_of(validate_generate(exports[0], server, **options))


# ---- greedy: the AR tokens, drafts accepted ----

@pytest.mark.parametrize("method", ["assisted", pytest.param("lookup", marks=needs_lookup)])
def test_greedy_speculative_decoding_gives_the_ar_tokens_with_drafts_accepted(exports, assisted, method):
    server = assisted if method == "assisted" else HFGenerate(assisted.target, lookup=3)
    report = validate_generate(exports[0], server)
    rows = rows_of(report)
    assert not report.failed, report.summary()
    assert [rows[f"tokens {p}"].status for p in PROMPTS] == [Status.EXACT] * 3
    speculation = rows["speculation"]
    assert speculation.status is Status.EXACT and report.checks[-1] is speculation
    drafted, accepted = server.tally.draft_tokens, server.tally.accepted
    assert drafted >= accepted > 0, speculation.detail
    assert f"{accepted} accepted" in speculation.detail and report.implementation.startswith("HF transformers")


@needs_lookup
def test_the_counts_cover_the_asked_positions_only(exports, assisted):
    """tiny p0's AR tokens hold 180 at 7 and 12, 184 after both: after the second, prompt lookup drafts
    184 296 17 (positions 13 to 15), the first draft of the run. Asked 14 tokens, only position 13 is
    asked (HF is asked 15, and drafts nothing before): one draft token counted, and it is accepted."""
    with kdtr_format.open(exports[0] / "tiny.kdtr") as reader:
        prompt, ar = (np.asarray(reader[f"prompts/p0/{name}"]).tolist() for name in ("tokens", "ar/tokens"))
    assert ar[7] == ar[12] == 180 and ar[8] == ar[13] == 184 and ar[9:11] == [296, 17]
    server = HFGenerate(assisted.target, lookup=3)
    assert server.generate(Ask(tuple(prompt), 14)).tokens == ar[:14]
    assert (server.tally.drafts, server.tally.draft_tokens, server.tally.accepted) == (1, 1, 1)


def test_logprobs_are_the_raw_model_log_softmax(exports, assisted):
    rows = judged(exports, assisted, logprobs=3)
    for p in PROMPTS:
        assert rows[f"logprobs {p}"].status is Status.WITHIN, rows[f"logprobs {p}"].text()
        assert "as log-softmax(logits)" in rows[f"logprobs {p}"].detail


# ---- sampling: the law, drafts accepted, seeds reproduce ----

@pytest.mark.slow
def test_assisted_sampling_follows_the_law(exports, assisted):
    rows = judged(exports, assisted, temperature=T, samples=RUNS, seed=11)
    for p in PROMPTS:
        law = rows[f"sampling {p}"]
        assert law.status is Status.WITHIN and law.error <= law.tolerance, law.text()
    assert "2 prefixes tested over 80 runs" in rows["sampling p0"].detail        # a later position too
    assert rows["speculation"].status is Status.EXACT, rows["speculation"].text()


def test_a_seed_reproduces_its_tokens(assisted):
    ask = Ask((200, 956, 861, 500, 253), 6, T, seed=3)
    first, again = assisted.generate(ask), assisted.generate(ask)
    others = {tuple(assisted.generate(dataclasses.replace(ask, seed=s)).tokens) for s in range(4, 12)}
    assert first.tokens == again.tokens and len(first.tokens) == 6
    assert len(others | {tuple(first.tokens)}) > 1


# ---- plants ----

@pytest.mark.parametrize("plant", [pytest.param("ensemble", marks=needs_ensemble), "draft as target"])
def test_drafts_taken_without_verification_fail_greedy(exports, assisted, plant):
    """HF's own lossy verification (assistant_ensemble_weight: DIVERSE's w p + (1 - w) q) keeps the
    draft's tokens; so does generating from the draft itself."""
    server = (HFGenerate(assisted.target, assisted.assistant, options={"assistant_ensemble_weight": 0.1})
              if plant == "ensemble" else HFGenerate(assisted.assistant, assisted.assistant))
    rows = judged(exports, server)
    failed = [p for p in PROMPTS if rows[f"tokens {p}"].status is Status.FAIL
              and rows[f"tokens {p}"].detail.startswith("at 0: served")]            # a token, not an error
    assert failed == list(PROMPTS), [rows[f"tokens {p}"].text() for p in PROMPTS]


def test_a_run_that_accepts_no_draft_fails_its_speculation_row(exports, assisted, monkeypatch):
    """Drafting off (the assistant's num_assistant_tokens 0), and drafts that are always wrong: the tokens
    pass, the run does not."""
    with monkeypatch.context() as patch:
        patch.setattr(assisted.assistant.generation_config, "num_assistant_tokens", 0)
        rows = judged(exports, HFGenerate(assisted.target, assisted.assistant))
    assert [rows[f"tokens {p}"].status for p in PROMPTS] == [Status.EXACT] * 3
    assert rows["speculation"].status is Status.FAIL and "0 drafts" in rows["speculation"].detail
    assert "drafted nothing" in rows["speculation"].detail

    candidates = transformers.generation.candidate_generator.AssistedCandidateGenerator.get_candidates

    def wrong(self, input_ids, **kwargs):
        ids, logits = candidates(self, input_ids, **kwargs)
        ids[:, input_ids.shape[1]:] = (ids[:, input_ids.shape[1]:] + 1) % self.assistant_model.config.vocab_size
        return ids, logits
    monkeypatch.setattr(transformers.generation.candidate_generator.AssistedCandidateGenerator, "get_candidates", wrong)
    server = HFGenerate(assisted.target, assisted.assistant)
    rows = judged(exports, server)
    assert [rows[f"tokens {p}"].status for p in PROMPTS] == [Status.EXACT] * 3
    assert server.tally.draft_tokens > 0 and server.tally.accepted == 0
    assert rows["speculation"].status is Status.FAIL, rows["speculation"].text()
    assert "0 accepted over the run: the server accepted no draft token" in rows["speculation"].detail


def first_token_power(exports, runs: int, other) -> dict[str, float]:
    """Per prompt, the chi-square part's power to tell the law at the first token from other(logits, prompt)."""
    from engine.validate.judging.distribution import chi_square_power

    def law(z: np.ndarray, t: float) -> np.ndarray:
        e = np.exp((z - z.max()) / t)
        return e / e.sum()
    with kdtr_format.open(exports[0] / "tiny.kdtr") as reader:
        regime = Regime.of(reader.metadata, "float32")
        cfg = kdtr_format.ModelConfig.from_dict(reader.metadata["config"])
        tests = sum(len(sampling_family(KnownPrefixes(CasesView(reader, regime), cfg, p), T, runs)) for p in PROMPTS)
        return {p: chi_square_power(law(z := np.asarray(reader[f"prompts/{p}/prefill_logits"], np.float64)[-1], T),
                                    other(z, np.asarray(reader[f"prompts/{p}/tokens"]), law), runs,
                                    alpha=ALPHA / tests) for p in PROMPTS}


class HotSampler(HFGenerate):
    """Samples at temperature 1 whatever it is asked."""

    def generate(self, ask: Ask):
        return super().generate(dataclasses.replace(ask, temperature=1.0))


@pytest.mark.slow
def test_a_sampler_at_the_wrong_temperature_fails_the_law(exports, assisted):
    power = first_token_power(exports, RUNS, lambda z, prompt, law: law(z, 1.0))
    assert 1 - np.prod([1 - v for v in power.values()]) > 0.999, power         # some prompt fails, surely
    rows = judged(exports, HotSampler(assisted.target, assisted.assistant), temperature=T, samples=RUNS)
    failed = [p for p in PROMPTS if rows[f"sampling {p}"].status is Status.FAIL
              and " fail; the worst " in rows[f"sampling {p}"].detail]                # the law, not an error
    assert failed and all(power[p] > 0.9 for p in failed), ([rows[f"sampling {p}"].text() for p in PROMPTS], power)


@pytest.mark.slow
@needs_ensemble
def test_drafts_taken_without_verification_fail_the_law(exports, assisted):
    """The ensemble's first token follows 0.1 p + 0.9 q'', q'' the draft's law as HF samples it (at T
    applied twice, docs/serving.md): far from p at every prompt."""
    def ensemble(z, prompt, law):
        with torch.no_grad():
            q = assisted.assistant(torch.tensor(prompt)[None]).logits[0, -1].double().numpy()
        return 0.1 * law(z, T) + 0.9 * law(q, T * T)
    power = first_token_power(exports, LOSSY, ensemble)
    assert min(power.values()) > 0.3 and 1 - np.prod([1 - v for v in power.values()]) > 0.999, power
    server = HFGenerate(assisted.target, assisted.assistant, options={"assistant_ensemble_weight": 0.1})
    rows = judged(exports, server, temperature=T, samples=LOSSY)
    assert any(rows[f"sampling {p}"].status is Status.FAIL and " fail; the worst " in rows[f"sampling {p}"].detail
               for p in PROMPTS), [rows[f"sampling {p}"].text() for p in PROMPTS]


# ---- bad input ----

def test_what_is_not_an_export_is_one_line(exports, assisted, tmp_path):
    with pytest.raises(ValidateError, match=r"no readable config.json"):
        load_export(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValidateError, match=r"not a DeepSeek checkpoint \(config.json's model_type 'llama'\)"):
        load_export(tmp_path)
    (tmp_path / "config.json").write_text((exports[0] / "config.json").read_text().replace('"float32"', '"float8"'))
    with pytest.raises(ValidateError, match=r"torch_dtype 'float8' weights: HF generate is judged in-process on "
                                            "float32 or bfloat16 exports"):
        load_export(tmp_path)
    config = json.loads((exports[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValidateError, match=r"quantized weights"):
        load_export(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValidateError, match=r"HF cannot load it \(OSError: "):
        load_export(tmp_path)                                                # no weights beside it
    with pytest.raises(ValidateError, match="one of them"):
        hf_generate(exports[0])
    with pytest.raises(ValidateError, match="one of them"):
        hf_generate(exports[0], assistant=exports[1], lookup=3)
    with pytest.raises(ValidateError, match="a draft model's export"):
        validate_generate(exports[1], HFGenerate(assisted.target, lookup=3))


def test_a_generate_that_raises_fails_each_request_in_one_line(exports, assisted, monkeypatch):
    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'crop'\n(in the cache)")
    monkeypatch.setattr(assisted.target, "generate", broken)
    rows = judged(exports, assisted)
    for p in PROMPTS:
        assert rows[f"tokens {p}"].status is Status.FAIL
        assert rows[f"tokens {p}"].detail == ("HF generate: AttributeError: 'NoneType' object has no attribute 'crop' "
                                              "(in the cache)")
