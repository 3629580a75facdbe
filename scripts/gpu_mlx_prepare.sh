#!/usr/bin/env bash
# Prepare, on this machine, the inputs of scripts/gpu_mlx_job.sh in JOB (default build/mlx-job):
#   JOB/parts/NAME/  each wheel larger than PART_MIB (default 58: mlx-cuda-13's 90 MB) in parts with a sha256 manifest
#   JOB/wheels/      the other wheels: mlx, mlx-lm, and the small ones the image may lack (installed there only if so)
#   JOB/adapters/    the packaged adapters (the default engine's)
# The wheels are for the GPU machine: CPython 3.12 on manylinux x86_64. MLX=0.32.4 and MLX_LM pin the versions.
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=${1:-build/mlx-job}
PY=${PYTHON:-python}
MLX=${MLX:-0.32.4}
PART_MIB=${PART_MIB:-58}
MLX_LM=${MLX_LM:-$($PY -c 'import importlib.metadata as m; print(m.version("mlx-lm"))')}
mkdir -p "$JOB/wheels" "$JOB/parts"
download() {
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$JOB/wheels" "$@"
}
download "mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==$MLX_LM" gguf jinja2 markupsafe pyyaml sentencepiece protobuf tqdm \
  llguidance
for wheel in "$JOB"/wheels/*.whl; do
  if [ "$(stat -c %s "$wheel")" -gt $((PART_MIB * 1048576)) ]; then
    name=$(basename "$wheel" .whl)
    $PY -m m2r2_torch.parts split "$wheel" "$JOB/parts/$name" --part-mib "$PART_MIB" --force
    rm "$wheel"
  fi
done
rm -rf "$JOB/adapters" && cp -r m2r2_mlx/trained/smollm2 "$JOB/adapters"
du -sh "$JOB"/*
