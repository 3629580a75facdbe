"""m2r2-convert: bring weights from other formats into MLX folders."""
