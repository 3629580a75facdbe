"""m2r2-server: OpenAI's HTTP API over M2R2 decoding (cli.py: flags; handler.py: HTTP; protocol.py: request and
response shapes; worker.py: the model thread)."""
