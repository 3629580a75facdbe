#!/usr/bin/env bash
# scripts/gpu_train_job.sh fitted to one call of BUDGET_S seconds (a lent GPU's whole session is often 15 minutes):
# the data stages run, then training runs PROBE_MINUTES to measure its speed (checkpointed), and resumes with the
# step count that ends RESERVE_S seconds (the held-out evaluation, the outputs) before the budget runs out.
#   BUDGET_S=480 scripts/gpu_timed_job.sh JOB RUN      # other knobs as in scripts/gpu_train_job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=${1:?usage: scripts/gpu_timed_job.sh JOB_DIR RUN_DIR}
RUN=${2:?usage: scripts/gpu_timed_job.sh JOB_DIR RUN_DIR}
BUDGET_S=${BUDGET_S:-480}
RESERVE_S=${RESERVE_S:-75}
PROBE_MINUTES=${PROBE_MINUTES:-0.75}
BATCH=${BATCH:-64}
SEQ_LEN=${SEQ_LEN:-256}
export BATCH SEQ_LEN
start=$(date +%s)
if [ ! -f "$RUN/adapters/torch/adapters.pt" ] && [ ! -f "$RUN/adapters/checkpoint/state.json" ]; then
  STEPS=1000000 MAX_MINUTES=$PROBE_MINUTES scripts/gpu_train_job.sh "$JOB" "$RUN"
fi
rate=$(grep -o 'at step [0-9]* of [0-9]*, [0-9]* tokens/s' "$RUN/job.log" | tail -1 | awk '{print $6}')
done_steps=$(grep -o 'at step [0-9]*' "$RUN/job.log" | tail -1 | awk '{print $3}')
left=$((BUDGET_S - ($(date +%s) - start) - RESERVE_S))
steps=$(python3 -c "print(max($done_steps + 1, $done_steps + int($rate * $left / ($BATCH * $SEQ_LEN))))")
echo "== training measured $rate tokens/s; $left s left for training: $steps steps in all"
STEPS=$steps MAX_MINUTES= scripts/gpu_train_job.sh "$JOB" "$RUN"
