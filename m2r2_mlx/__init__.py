"""m2r2-mlx: Mixture of Multi-Rate Residuals decoding on MLX.

Importing this package first preloads an optimised BLAS on Linux (see blas.py);
it must happen before ``mlx.core`` is imported anywhere in the process.
"""

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # mlx-lm's tokenizers need no PyTorch; hush that notice

from .blas import ensure_fast_blas

ensure_fast_blas()

__version__ = "0.1.0"
