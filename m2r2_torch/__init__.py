"""The PyTorch side of m2r2: M2R2's modules (modules), its fast stream over a transformers causal LM (fast_stream),
the base found by m2r2's model names (base), batched generation (generate) and the trainer for GPUs, one or many
(train: m2r2-train-torch, with its processes in distributed, its step in step, its held-out evaluation in evaluate
and its adapters on disk in checkpoint). Needs torch and transformers (pip install 'm2r2-mlx[train]'); mlx is
optional."""
