"""The independent check behind a llama.cpp row that fails on tiny: HF transformers' greedy tokens
on the export as it is, and on a copy whose rope_scaling.mscale is set to mscale_all_dim (YaRN's
attention factor as llama.cpp computes it), beside the fixture's AR tokens and what a server
served.

    python3 scripts/engines/hf_rope_check.py EXPORT_DIR [--server URL]

Prints one block per prompt: the fixture's AR tokens, HF's on the export, HF's with mscale =
mscale_all_dim, the server's (when given), and which of them agree. Exit 0 when HF on the export
gives the AR tokens (transformers computes the export as the reference does) and, with --server,
the served tokens equal HF's with mscale = mscale_all_dim; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.serving import Ask, client  # noqa: E402


def greedy(directory: Path, prompt: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              experts_implementation="eager",
                                                              attn_implementation="eager")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--server", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    manifest = json.loads((args.export / "kdtree-export.json").read_text())
    config = json.loads((args.export / "config.json").read_text())
    scaling = config["rope_scaling"]
    words = json.loads((args.export / "tokenizer.json").read_text())["model"]["vocab"]     # the reply's text -> ids
    ok = True
    with tempfile.TemporaryDirectory() as scratch:
        edited = Path(scratch) / "export"
        shutil.copytree(args.export, edited, ignore=shutil.ignore_patterns("*.gguf", "*.kdtr"))
        config["rope_scaling"] = {**scaling, "mscale": scaling["mscale_all_dim"]}
        (edited / "config.json").write_text(json.dumps(config, indent=2))
        print(f"rope_scaling: mscale {scaling['mscale']}, mscale_all_dim {scaling['mscale_all_dim']}")
        for prompt in manifest["prompts"]:
            tokens, want = prompt["tokens"], prompt["ar_tokens"]
            as_is = greedy(args.export, tokens, len(want))
            mscaled = greedy(edited, tokens, len(want))
            print(f"{prompt['name']}: fixture AR             {want}")
            print(f"{prompt['name']}: HF on the export       {as_is}  {'= AR' if as_is == want else '!= AR'}")
            print(f"{prompt['name']}: HF, mscale := all_dim  {mscaled}  {'= AR' if mscaled == want else '!= AR'}")
            ok &= as_is == want
            if args.server:
                served = client("openai", args.server, 60.0, words).generate(Ask(tuple(tokens), len(want))).tokens
                print(f"{prompt['name']}: served                 {served}  "
                      f"{'= HF with mscale := all_dim' if served == mscaled else '!= HF with mscale := all_dim'}")
                ok &= served == mscaled
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
