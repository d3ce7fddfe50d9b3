"""Runs inside vLLM's interpreter (tests/vllm_python.py), never imported by the suite: vLLM's own
code applied to `refgen export` directories. Prints one JSON line.

    python vllm_side.py config DIR...     vLLM's draft-config rewrite of each DIR's config.json
"""

from __future__ import annotations

import json
import sys


def draft_configs(directories: list[str]) -> list[dict]:
    """What vLLM makes of each directory as a speculative draft: SpeculativeConfig.hf_config_override
    (applied to every draft model's config) -> its architectures, model_type and n_predict."""
    from transformers import AutoConfig
    from vllm.config.speculative import SpeculativeConfig

    found = []
    for directory in directories:
        config = SpeculativeConfig.hf_config_override(AutoConfig.from_pretrained(directory))
        found.append({"architectures": list(config.architectures), "model_type": config.model_type,
                      "n_predict": getattr(config, "n_predict", None)})
    return found


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "config":
        print(json.dumps(draft_configs(rest)))
    else:
        sys.exit(f"unknown command {command!r}")
