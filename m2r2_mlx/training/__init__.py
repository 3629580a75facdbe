"""Training M2R2 adapters on MLX: m2r2-train (train), its data (data, magpie), objective (losses),
CPU kernels, exit-decision training (exit_decisions) and held-out evaluation (evaluate)."""
