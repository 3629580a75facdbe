"""Device-to-host reads in the decoding loops, in one place and counted.

Each read makes the host wait for the device: on a GPU a round trip per read, which cutting from four to one per
speculative step was worth 4-20% on Apple GPUs (omlx #2403). The decoders read through ``read`` so that
tests/test_host_reads.py can hold them to their budget: one read per token in plain decoding (and in a speculative
engine's plain stretch), at most one per draft-and-verify step where the step's drafting is planned ahead.
"""

from __future__ import annotations

import mlx.core as mx

_count = [0]


def read(x: mx.array):
    """``x`` on the host: a Python number for a 0-d array, else a (nested) list."""
    _count[0] += 1
    return x.item() if x.ndim == 0 else x.tolist()


def reads() -> int:
    """Reads made in this process so far (tests take differences)."""
    return _count[0]
