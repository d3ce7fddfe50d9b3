#!/usr/bin/env bash
# llama.cpp (the source llama-cpp-python's sdist vendors, pinned in install.py, built CPU-only)
# against the fixtures: builds llama-server into ~/.cache/kdtree/engines/llama-cpp (reused when
# intact), exports, serves each configuration on 127.0.0.1, runs `kdtree validate --server`
# (greedy, --concurrency 4, --logprobs, sampling) and writes docs/results/engines.md
# (run_engine.py says how). Arguments go to run_engine.py (--only NAME, --runs LIST). Exit 0:
# every row as expected; 1: a new failure or a fixed defect; 2: the engine or a server could not
# be installed or started.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 scripts/engines/run_engine.py llama-cpp "$@"
