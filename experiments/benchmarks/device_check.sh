#!/usr/bin/env bash
# One call on a lent GPU, at most 8 minutes, one JSON: decode at 1 / 64 / 256 rows and with
# 2,048-token prompts, the packed update at stage-1 lengths (useful MFU, bfloat16 compute,
# float32 master weights), a shortened whole RL step of experiments/paper/stage1.yaml on random
# Qwen3-0.6B weights (rollout devices split from the training ones where there are two or more
# GPUs), and aot_report.py's figures for the same programs compiled deviceless beside them.
#
#   experiments/benchmarks/device_check.sh [OUT.json]               # on the GPU machine
#   experiments/benchmarks/device_check.sh --cpu-smoke [OUT.json]   # tiny shapes, this CPU
#
# Needs JAX for the GPU (docs/accelerators.md) and the test requirements (the RL step's
# tokenizer is built by tests/helpers_qwen_tokenizer.py). Each part runs under a time limit;
# one that fails is recorded in "errors" and the others still run.
set -uo pipefail
cd "$(dirname "$0")/../.."
smoke=()
if [ "${1:-}" = "--cpu-smoke" ]; then smoke=(--cpu-smoke); shift; export JAX_PLATFORMS=cpu; fi
out=${1:-device_check.json}
exec python experiments/benchmarks/device_check.py "$out" "${smoke[@]}"
