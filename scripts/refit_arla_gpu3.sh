#!/usr/bin/env bash
# Candidate v11 for the embedded SmolLM2-135M: GPU run 3's first interval spliced onto the packaged deeper intervals
# (data/smollm2-gpu3/adapters, tools/splice_adapters.py), with ARLA trained anew on this CPU for that first gate:
# the states the exit decision reads at gate 6 changed, so the packaged ARLA no longer fits them.
# The rows are data v3's (its prompts and self-distilled answers are in data/smollm2-v3: packed, not regenerated).
# Cost on this project's 2-core x86 CPU: packing ~1 min, ARLA ~5-10 min. Output: build/smollm2-v11.
set -euo pipefail
cd "$(dirname "$0")/.."
rows=build/data-v3
mkdir -p $rows
[ -f $rows/prompts.jsonl ] || gunzip -c data/smollm2-v3/prompts.jsonl.gz > $rows/prompts.jsonl
[ -f $rows/distilled.jsonl ] || gunzip -c data/smollm2-v3/distilled.jsonl.gz > $rows/distilled.jsonl
m2r2-train --stage data --prompts $rows/prompts.jsonl --answer-tokens 192 --seq-len 256 -o $rows --resume
m2r2-train --model smollm2 --data $rows/data.npy --init data/smollm2-gpu3/adapters --stage arla --eval-rows 24 \
  --arla-rows 96 --arla-steps 600 --exit-vocab 4096 -o build/smollm2-v11 --force
echo "build/smollm2-v11: gpu3's first interval, ARLA refit (compare: m2r2-bench --methods plain,early-exit,fast)"
