"""Which base model adapters were made for: a hash of its architecture's config.

Plain Python (no mlx), so that the PyTorch trainer (m2r2_torch) records and checks bases the way
m2r2_mlx.core.adapters does, on machines without mlx.
"""

from __future__ import annotations

import hashlib
import json


def config_hash(config: dict) -> str:
    """A short, stable hash of the fields that define a base model's architecture."""
    keys = sorted(
        k
        for k in config
        if not k.startswith("_")
        and k not in ("torch_dtype", "transformers_version", "quantization", "quantization_config")
    )
    blob = json.dumps({k: config[k] for k in keys}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
