"""Studies behind the tables in docs/: each module is runnable (``python -m experiments.NAME``) and writes its
table into --out (build/ by default); the page that cites a table names the command and the commit. Not installed
with the package: run them from a clone."""

from pathlib import Path


def write_results(text: str, out: Path | None) -> None:
    """Print a study's table and, with ``--out``, write it to ``out/results.md`` (atomically)."""
    from m2r2_mlx.atomic import atomic_write_text  # here, not above: gemv_rows binds its BLAS before m2r2_mlx loads

    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "results.md", text)
