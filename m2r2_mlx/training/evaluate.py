"""Top-1 agreement of gate exits with the full model: naive early exit vs the M2R2 fast stream."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..core.fast_stream import shift_right


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

    ``batches`` yields (ids, positions) or (ids, positions, mask): token ids (B, T), the slice of positions
    to score, and optionally a boolean (B, scored positions) array; with masks, the figures over the masked
    positions alone come too, under "scored".
    """
    gates = m2r2.config.gates
    counts = {k: np.zeros(len(gates)) for k in ("layerskip", "fast", "layerskip_scored", "fast_scored")}
    total = scored = 0
    masked = False
    for ids, positions, *mask in batches:
        n, f = exit_matches(m2r2, ids, positions)
        n, f = np.array(n), np.array(f)
        counts["layerskip"] += n.sum((1, 2))
        counts["fast"] += f.sum((1, 2))
        total += n[0].size
        if mask and mask[0] is not None:
            masked, m = True, np.asarray(mask[0], dtype=bool)
            counts["layerskip_scored"] += n[:, m].sum(1)
            counts["fast_scored"] += f[:, m].sum(1)
            scored += int(m.sum())
    out = {
        "gates": list(gates),
        "layerskip": (counts["layerskip"] / total).tolist(),
        "fast": (counts["fast"] / total).tolist(),
        "tokens": total,
    }
    if masked:
        out["scored"] = {
            "layerskip": (counts["layerskip_scored"] / max(scored, 1)).tolist(),
            "fast": (counts["fast_scored"] / max(scored, 1)).tolist(),
            "tokens": scored,
        }
    return out


def row_batches(rows: np.ndarray, batch_size: int = 4, mask: np.ndarray | None = None):
    """``agreement`` batches over fixed-length token rows, every position scored (``mask``: their loss mask)."""
    return (
        (mx.array(rows[i : i + batch_size]), slice(None), None if mask is None else mask[i : i + batch_size])
        for i in range(0, len(rows), batch_size)
    )


def answer_batches(sequences: list[tuple[list[int], int]]):
    """``agreement`` batches over (tokens, prompt_length) sequences, scoring the positions that predict answer
    tokens."""
    return ((mx.array(toks)[None], slice(plen - 1, -1)) for toks, plen in sequences)


def gate_agreement(m2r2, rows: np.ndarray, batch_size: int = 4, mask: np.ndarray | None = None) -> dict:
    """Agreement at every position of fixed-length token rows; with their loss ``mask`` (data.pack_loss_mask),
    also at the positions it scores (answers and text, not prompts), under "scored"."""
    return agreement(m2r2, row_batches(rows, batch_size, mask))


def answer_agreement(m2r2, sequences: list[tuple[list[int], int]]) -> dict:
    """Agreement at the positions that predict answer tokens; sequences are (tokens, prompt_length)."""
    return agreement(m2r2, answer_batches(sequences))


def naive_agreement_by_layer(parts, batches) -> list[float]:
    """The naive exit's agreement (final norm + LM head on the slow state) after every layer of the base, not just
    at the gates: how late the model settles on its token. ``parts``: BaseParts; ``batches`` as for ``agreement``."""
    hits, total = np.zeros(parts.num_layers), 0
    for ids, positions, *_ in batches:
        h = parts.embed(ids)
        mask, exits = parts.mask(h, None), []
        for i in range(parts.num_layers):
            h = parts.run_layers(h, i, i + 1, mask)
            exits.append(parts.head(h[:, positions]).argmax(-1))
        for i, e in enumerate(exits):
            hits[i] += int((e == exits[-1]).sum())
        total += exits[-1].size
    return (hits / max(total, 1)).tolist()


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
    labels = [
        np.array(exit_matches(m2r2, ids, positions, head)[1][:, 0]).T for ids, positions in answer_batches(sequences)
    ]
    return perfect_rule_saving(np.concatenate(labels), 1 - np.array(m2r2.config.gates) / m2r2.parts.num_layers, slack)


def first_gate_by_context(m2r2, states: dict, kv) -> dict[str, mx.array]:
    """The first gate's fast state (B, T, D), teacher-forced (``slow_pass``'s states and K/V), with the context
    feature reading each position's previous final state ("final"), the previous position's own first-gate exit
    state ("stand-in", itself computed from the final state before it) or nothing ("none")."""
    first_gate = lambda prev: m2r2.fast_states({**states, "prev": prev}, kv, [0])[0]
    h = first_gate(states["prev"])
    stand_in = shift_right(h)
    return {"final": h, "stand-in": first_gate(stand_in), "none": first_gate(mx.zeros_like(stand_in))}


def context_feature_ablation(m2r2, batches) -> dict:
    """First-gate agreement of adapters with a context feature, by what the feature reads (first_gate_by_context):
    "final" is training's input and a first draft's at decode time; "stand-in" what a second or third draft reads
    (the draft before's exit state: no final state exists there yet); "none" the feature zeroed. "after a right
    exit" keeps only positions whose previous first-gate exit was right, as before a second draft. A row's first
    position has no previous one and is not scored. ``batches`` as for ``agreement`` (masks ignored)."""
    parts = m2r2.parts
    hits = {k: np.zeros(2) for k in ("final", "stand-in", "none")}  # [all positions, after a right exit]
    total = after_right = 0
    for ids, positions, *_ in batches:
        states, final, kv = m2r2.slow_pass(ids)
        target = parts.head(final).argmax(-1)
        right = {
            name: parts.head(h).argmax(-1) == target for name, h in first_gate_by_context(m2r2, states, kv).items()
        }
        prev_right = np.array(shift_right(right["final"]))
        right = {name: np.array(r) for name, r in right.items()}
        scored = np.zeros(prev_right.shape, dtype=bool)
        scored[:, positions] = True
        scored[:, 0] = False
        for name, r in right.items():
            hits[name] += [(r & scored).sum(), (r & scored & prev_right).sum()]
        total += int(scored.sum())
        after_right += int((scored & prev_right).sum())
    return {
        "tokens": total,
        "after a right exit": after_right,
        **{name: (h / [max(total, 1), max(after_right, 1)]).tolist() for name, h in hits.items()},
    }
