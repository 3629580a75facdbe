"""Base models: loading by name (registry), GGUF import, uniform access to a decoder's parts, Linux BLAS.

Kept free of imports: ``m2r2_mlx/__init__`` loads ``models.blas`` before anything imports mlx.
"""
