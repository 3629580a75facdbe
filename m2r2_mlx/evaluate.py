"""Top-1 agreement of gate exits with the full model: naive early exit vs the M2R2 fast stream."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def agreement(m2r2, batches) -> dict:
    """For each gate: share of scored positions whose exit argmax equals the final layer's argmax.

    ``batches`` yields (ids, positions): token ids (B, T) and the slice of positions to score.
    ``naive`` exits the slow state at the gate through final norm + LM head;
    ``m2r2`` exits the fast stream's state there.
    """
    parts, gates = m2r2.parts, m2r2.config.gates
    naive = np.zeros(len(gates))
    fast = np.zeros(len(gates))
    total = 0
    for ids, positions in batches:
        states, final, kv = m2r2.slow_pass(ids)
        target = parts.head(final).argmax(-1)[:, positions]
        fast_states = m2r2.fast_states(states, kv)
        for j, g in enumerate(gates):
            naive[j] += (parts.head(states[g]).argmax(-1)[:, positions] == target).sum().item()
            fast[j] += (parts.head(fast_states[j]).argmax(-1)[:, positions] == target).sum().item()
        total += target.size
    return {"gates": list(gates), "naive": (naive / total).tolist(), "m2r2": (fast / total).tolist(), "tokens": total}


def gate_agreement(m2r2, rows: np.ndarray, batch_size: int = 4) -> dict:
    """Agreement at every position of fixed-length token rows."""
    return agreement(m2r2, ((mx.array(rows[i : i + batch_size]), slice(None)) for i in range(0, len(rows), batch_size)))


def answer_agreement(m2r2, sequences: list[tuple[list[int], int]]) -> dict:
    """Agreement at the positions that predict answer tokens; sequences are (tokens, prompt_length)."""
    return agreement(m2r2, ((mx.array(toks)[None], slice(plen - 1, -1)) for toks, plen in sequences))
