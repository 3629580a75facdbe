"""One-row matrix products through the BLAS's matrix-vector kernel: what a plain decode step would gain on Linux.

MLX's CPU backend calls ``cblas_sgemm`` for every matrix product, the one-row products of a decode step included
(751 a step on the embedded model). OpenBLAS's sgemm packs a one-row product's operands as it would a matrix's; its
sgemv streams the weights. This study compiles a small library (C; a compiler is needed) whose ``cblas_sgemm`` sends
one-row, row-major products to the BLAS's ``cblas_sgemv`` and the rest to its ``cblas_sgemm``, loads it before the
BLAS and before ``mlx.core`` (so libmlx resolves ``cblas_sgemm`` to it), and times plain greedy steps on the embedded
model with the routing on and off in turns, in one process (the switch is a flag in the library): medians of
``--rounds`` rounds of ``--tokens`` steps each. Tokens are compared between the two.

    python -m experiments.gemv_rows --blas /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python -m experiments.gemv_rows --blas /path/to/cmeel.prefix/lib/libopenblas.so.0 --out build/gemv_rows
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments import write_results

ROUTER = r"""
#include <dlfcn.h>
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;
int gemv_rows = 1;
long rows_routed;

int bind_blas(void *blas) {
    blas_sgemm = (sgemm_fn)dlsym(blas, "cblas_sgemm");
    blas_sgemv = (sgemv_fn)dlsym(blas, "cblas_sgemv");
    return blas_sgemm && blas_sgemv;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (gemv_rows && m == 1 && order == ROW_MAJOR) {  /* c (1 x n) = alpha a op(b) + beta c */
        int inc_a = trans_a == NO_TRANS ? 1 : lda;
        if (trans_b == NO_TRANS)  /* b is k x n: c = b^T a */
            blas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
        else  /* b is n x k: c = b a */
            blas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
        rows_routed++;
        return;
    }
    blas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""
PROMPTS = ["Explain how a bicycle stays upright.", "Write a short poem about the sea."]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.gemv_rows", description=__doc__.split("\n")[0])
    ap.add_argument("--blas", required=True, help="the BLAS library (a libopenblas.so.0)")
    ap.add_argument("--tokens", type=int, default=24, help="greedy steps per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None, help="results.md here")
    return ap


def load_router(blas: str) -> ctypes.CDLL:
    """The routing library, compiled and loaded with global symbols ahead of the BLAS and of libmlx."""
    if "mlx.core" in sys.modules:
        sys.exit("run this as its own process: mlx.core is already loaded, so its cblas_sgemm is already bound")
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        sys.exit("no C compiler (cc): this study compiles its routing library; install gcc or clang")
    if not Path(blas).is_file():
        sys.exit(f"--blas {blas}: no such file; give a libopenblas.so.0 (Debian: libopenblas0-pthread)")
    with tempfile.TemporaryDirectory(prefix="gemv_rows-") as folder:  # loaded libraries outlive their files
        source, built = Path(folder) / "router.c", Path(folder) / "router.so"
        source.write_text(ROUTER)
        compiled = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", source, "-o", built, "-ldl"], capture_output=True, text=True
        )
        if compiled.returncode != 0:
            sys.exit(f"{cc} could not build the routing library: {(compiled.stderr.strip().splitlines() or ['?'])[0]}")
        router = ctypes.CDLL(str(built), mode=ctypes.RTLD_GLOBAL)
    try:
        library = ctypes.CDLL(blas, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        sys.exit(f"--blas {blas}: not a loadable library ({e})")
    if not router.bind_blas(ctypes.c_void_p(library._handle)):
        sys.exit(f"--blas {blas}: has no cblas_sgemm and cblas_sgemv")
    os.environ["M2R2_BLAS"] = "reference"  # m2r2 must not preload another BLAS: this one is bound already
    return router


def main() -> None:
    args = build_parser().parse_args()
    router = load_router(args.blas)
    switch = ctypes.c_int.in_dll(router, "gemv_rows")

    import m2r2_mlx  # noqa: F401  (after the router: libmlx binds cblas_sgemm when mlx.core loads)
    from m2r2_mlx.decoding.config import GenerationConfig
    from m2r2_mlx.decoding.generate import generate
    from m2r2_mlx.models.registry import load_model

    lm = load_model()
    prompts = [
        lm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS
    ]
    step_ms = {0: [], 1: []}
    tokens = {0: [], 1: []}
    for r in range(args.rounds):
        for on in (0, 1) if r % 2 == 0 else (1, 0):
            switch.value = on
            prompt = prompts[r % len(prompts)]
            events = list(generate(lm.model, lm.tokenizer, prompt, GenerationConfig(args.tokens + 1)))
            decode_s = events[-1].timing.elapsed_s - events[0].timing.elapsed_s
            step_ms[on].append(1e3 * decode_s / (len(events) - 1))
            tokens[on].append([e.token for e in events])
    off, on = statistics.median(step_ms[0]), statistics.median(step_ms[1])
    routed = ctypes.c_long.in_dll(router, "rows_routed").value
    lines = [
        f"`python -m experiments.gemv_rows {' '.join(sys.argv[1:])}`",
        "",
        f"BLAS: {args.blas}. {args.rounds} rounds of {args.tokens} plain greedy steps, routing off and on in turns.",
        "",
        "| one-row products | ms per step (median) | speedup |",
        "|---|---:|---:|",
        f"| sgemm (as MLX calls them) | {off:.1f} | 1.00x |",
        f"| sgemv (routed) | {on:.1f} | {off / on:.2f}x |",
        "",
        f"Products routed: {routed}. Tokens equal with and without routing: {tokens[0] == tokens[1]}.",
    ]
    text = "\n".join(lines) + "\n"
    write_results(text, args.out)


if __name__ == "__main__":
    main()
