"""Top-1 agreement of gate exits with the full model: naive early exit vs the M2R2 fast stream."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def exit_matches(m2r2, ids: mx.array, positions: slice, head=None) -> tuple[mx.array, mx.array]:
    """Per gate, whether the exit token equals the full model's token at ``positions`` of ``ids`` (B, T):
    (naive, fast), each bool (gates, B, positions). ``naive`` exits the slow state at the gate through
    final norm + LM head, ``fast`` the M2R2 fast stream's state there; ``head`` (a SubsetHead) picks
    exit tokens from a vocabulary subset, as early exit does with ``m2r2.exit_head``."""
    parts, gates = m2r2.parts, m2r2.config.gates
    exit_token = (lambda h: parts.head(h).argmax(-1)) if head is None else (lambda h: head.ids[head(h).argmax(-1)])
    states, final, kv = m2r2.slow_pass(ids)
    target = parts.head(final).argmax(-1)[:, positions]
    naive = mx.stack([exit_token(states[g])[:, positions] == target for g in gates])
    fast = mx.stack([exit_token(h)[:, positions] == target for h in m2r2.fast_states(states, kv)])
    return naive, fast


def agreement(m2r2, batches) -> dict:
    """For each gate: share of scored positions whose exit argmax equals the final layer's argmax.

    ``batches`` yields (ids, positions): token ids (B, T) and the slice of positions to score.
    """
    gates = m2r2.config.gates
    naive = np.zeros(len(gates))
    fast = np.zeros(len(gates))
    total = 0
    for ids, positions in batches:
        n, f = exit_matches(m2r2, ids, positions)
        naive += np.array(n.sum((1, 2)))
        fast += np.array(f.sum((1, 2)))
        total += n[0].size
    return {"gates": list(gates), "naive": (naive / total).tolist(), "m2r2": (fast / total).tolist(), "tokens": total}


def gate_agreement(m2r2, rows: np.ndarray, batch_size: int = 4) -> dict:
    """Agreement at every position of fixed-length token rows."""
    return agreement(m2r2, ((mx.array(rows[i : i + batch_size]), slice(None)) for i in range(0, len(rows), batch_size)))


def answer_agreement(m2r2, sequences: list[tuple[list[int], int]]) -> dict:
    """Agreement at the positions that predict answer tokens; sequences are (tokens, prompt_length)."""
    return agreement(m2r2, ((mx.array(toks)[None], slice(plen - 1, -1)) for toks, plen in sequences))


def perfect_rule_saving(labels: np.ndarray, saved_at: np.ndarray, slack: float = 0.0) -> float:
    """Exit-depth saved by a perfect exit rule, the bound on any rule, from ``labels`` (tokens, gates): whether
    each gate's exit is the full model's token; ``saved_at`` (gates,): the share of layers an exit there saves.

    Each token leaves at the first gate whose exit is right (none: it runs every layer). With ``slack``
    (e.g. 0.05), that share of the tokens, those that gain most, leave at the first gate though it is
    wrong there: the most a rule may save at 1 - slack agreement.
    """
    labels = labels.astype(bool)
    per_token = np.where(labels.any(1), saved_at[labels.argmax(1)], 0.0)
    gains = np.sort(saved_at[0] - per_token)[::-1][: int(slack * len(per_token))]
    return float((per_token.sum() + gains.sum()) / len(per_token))


def oracle_exit_saving(m2r2, sequences: list[tuple[list[int], int]], slack: float = 0.0, head=None) -> float:
    """``perfect_rule_saving`` on answers (tokens, prompt_length), exits picked over ``head``'s vocabulary."""
    labels = [np.array(exit_matches(m2r2, mx.array(toks)[None], slice(plen - 1, -1), head)[1][:, 0]).T
              for toks, plen in sequences]
    return perfect_rule_saving(np.concatenate(labels), 1 - np.array(m2r2.config.gates) / m2r2.parts.num_layers, slack)
