"""Studies behind the tables in docs/: each module is runnable (``python -m experiments.NAME``) and writes its
table into --out (build/ by default); the page that cites a table names the command and the commit. Not installed
with the package: run them from a clone."""
