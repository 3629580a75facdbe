"""Studies behind docs/: each module is runnable (``python -m experiments.NAME``) and rewrites the doc it
produced. Not installed with the package: run them from a clone."""
