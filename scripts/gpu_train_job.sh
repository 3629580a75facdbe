#!/usr/bin/env bash
# The whole GPU run of issue 24 on one machine with PyTorch and transformers and no network, planned for ~25 minutes
# of one H100 (measure each stage's minutes in RUN/job.log and scale the knobs to the next budget):
#   scripts/gpu_train_job.sh JOB RUN      # JOB from scripts/gpu_job_prepare.sh; RUN receives everything
# 1. join the GGUF's parts, every sha256 checked; 2. import it exactly as m2r2 does on the CPU (float32, the same
# config.json, so the adapters name the same base); 3. sample MAGPIE requests (transformers, temperature 1, top-p 0.95,
# Spec-Bench decontaminated); 4. self-distil: the base answers JOB's prompts and those requests (greedy, bf16,
# batched; the answer log resumes); 5. train (m2r2-train-torch, NPROC processes under torchrun when > 1);
# 6. the held-out agreement table is in RUN/job.log; RUN/adapters/torch holds the PyTorch checkpoint, which
#    `m2r2-convert RUN/adapters/torch --base smollm2 -o DIR` turns into MLX adapters here (where mlx is installed,
#    RUN/adapters is that folder already).
# Each stage skips what an earlier call finished and training resumes from its checkpoint, so the job can run as
# several calls of a few minutes each (MAX_MINUTES bounds one call's training).
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=${1:?usage: scripts/gpu_train_job.sh JOB_DIR RUN_DIR}
RUN=${2:?usage: scripts/gpu_train_job.sh JOB_DIR RUN_DIR}
PY=${PYTHON:-python3}
MAGPIE=${MAGPIE:-20000}            # Magpie requests to sample
MAGPIE_TOKENS=${MAGPIE_TOKENS:-96}
ANSWER_TOKENS=${ANSWER_TOKENS:-192}
GEN_BATCH=${GEN_BATCH:-512}        # prompts per generation pass
SEQ_LEN=${SEQ_LEN:-256}
BATCH=${BATCH:-64}                 # rows per step, over all processes
STEPS=${STEPS:-2000}
LR=${LR:-2e-3}
RANK=${RANK:-256,64,64,64}   # the packaged recipe: the drafting interval wider
CONTEXT=${CONTEXT:-1}        # the first interval reads the previous position's final state (--context-feature)
GATES=${GATES:-6,12,18,24}
INIT=${INIT:-}                # warm start from this adapters folder (its rank and context feature; RANK, CONTEXT unused)
TRAIN_GATES=${TRAIN_GATES:-}  # e.g. 6: train that gate's interval only; the others stay as INIT has them
NPROC=${NPROC:-1}
DEVICE=${DEVICE:-}                 # cpu for the rehearsal; default: cuda when there is one
mkdir -p "$RUN"
exec > >(tee -a "$RUN/job.log") 2>&1
stage() { echo "== $(date -u +%FT%TZ) $*"; }
device=${DEVICE:+--device $DEVICE}

if compgen -G "$JOB/wheels/*.whl" > /dev/null && ! $PY -c "import gguf" 2> /dev/null; then
  [ -d "$RUN/site/gguf" ] || $PY -m pip install -q --no-index --no-deps --target "$RUN/site" "$JOB"/wheels/*.whl
  export PYTHONPATH=$RUN/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

stage "1 join the GGUF's parts"
[ -f "$RUN/base.gguf" ] || $PY -m m2r2_torch.parts join "$JOB/gguf" "$RUN/base.gguf"
stage "2 import the GGUF (float32, as m2r2's importer does on the CPU)"
$PY -c "import sys; from m2r2_mlx.models.gguf_import import import_gguf; print(import_gguf(sys.argv[1], sys.argv[2]))" \
  "$RUN/base.gguf" "$RUN/base"
if [ -f "$JOB/answers.jsonl.gz" ] && [ ! -f "$RUN/data/distilled.jsonl" ]; then  # an earlier run's (FROM=...)
  mkdir -p "$RUN/data" && gunzip -c "$JOB/answers.jsonl.gz" > "$RUN/data/distilled.jsonl"
  : > "$RUN/magpie.jsonl"  # its prompts hold its Magpie requests already
fi
stage "3 sample $MAGPIE Magpie requests"
[ -f "$RUN/magpie.jsonl" ] || $PY -m m2r2_torch.magpie -n "$MAGPIE" --model "$RUN/base" --max-tokens "$MAGPIE_TOKENS" \
  --batch-size "$GEN_BATCH" --decontaminate bench/data/question.jsonl -o "$RUN/magpie.jsonl"
cat "$JOB/prompts.jsonl" "$RUN/magpie.jsonl" > "$RUN/prompts.jsonl"
stage "4 self-distil $(wc -l < "$RUN/prompts.jsonl") conversations"
text=$([ -f "$JOB/text.txt" ] && echo "--text $JOB/text.txt" || true)
$PY -m m2r2_torch.train --stage data --resume --model "$RUN/base" --base-name smollm2 --prompts "$RUN/prompts.jsonl" \
  $text --answer-tokens "$ANSWER_TOKENS" --generate-batch "$GEN_BATCH" --seq-len "$SEQ_LEN" -o "$RUN/data" $device
stage "5 train $STEPS steps of $BATCH x $SEQ_LEN tokens on $NPROC process(es)"
if [ -f "$RUN/adapters/torch/adapters.pt" ]; then
  echo "already trained: $RUN/adapters"
else
  if [ -f "$RUN/adapters/checkpoint/state.json" ]; then again=--resume; else again=--force; fi
  if [ -n "$INIT" ]; then shape=(--init "$INIT"); else shape=(--rank "$RANK"); fi
  [ -n "$INIT" ] || [ "$CONTEXT" != 1 ] || shape+=(--context-feature)
  [ -z "$TRAIN_GATES" ] || shape+=(--train-gates "$TRAIN_GATES")
  launch=("$PY" -m m2r2_torch.train)
  [ "$NPROC" -gt 1 ] && launch=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m m2r2_torch.train)
  "${launch[@]}" --model "$RUN/base" --base-name smollm2 --data "$RUN/data/data.npy" --seq-len "$SEQ_LEN" \
    --batch-size "$BATCH" --steps "$STEPS" --lr "$LR" --gates "$GATES" "${shape[@]}" --eval-rows 64 \
    --checkpoint-every 100 -o "$RUN/adapters" $again $device ${MAX_MINUTES:+--max-minutes $MAX_MINUTES}
fi
stage "6 done"
if [ -f "$RUN/adapters/torch/adapters.pt" ]; then
  gzip -c "$RUN/data/distilled.jsonl" > "$RUN/distilled.jsonl.gz"  # the answers: worth keeping, like data/smollm2-v*
  gzip -c "$RUN/magpie.jsonl" > "$RUN/magpie.jsonl.gz"
  echo "bring back: $RUN/adapters/torch/{adapters.pt,m2r2_config.json,draft_vocab.json}, $RUN/job.log, \
$RUN/distilled.jsonl.gz, $RUN/magpie.jsonl.gz"
else
  echo "training stopped before its last step; run the same command again to continue"
fi
