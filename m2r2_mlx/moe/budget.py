"""Expert budgets: a share of all experts ("25%", 0.25) or bytes ("2GB"), turned into slots per MoE layer."""

from __future__ import annotations

import re

from ..errors import M2R2Error
from .store import ExpertStore

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_budget(budget: float | int | str) -> tuple[str, float]:
    """("fraction", f) or ("bytes", n) from 0.5 / "50%" (fractions of all experts) or 2_000_000 / "2GB" / "1.5GiB".

    A float is a fraction, an int a byte count; in a string a bare number up to 1 is a fraction.
    """
    bad = M2R2Error(f"expert budget {budget!r} is not a fraction of the experts (0.5 or 50%) or a size (2GB, 512MiB)")
    if isinstance(budget, bool):
        raise bad
    if isinstance(budget, str):
        text = budget.strip()
        try:
            if text.endswith("%"):
                kind, value = "fraction", float(text[:-1]) / 100
            elif (m := _SIZE.match(text)) is not None:
                unit = m.group(2).lower().rstrip("b") or "b"
                kind, value = "bytes", float(m.group(1)) * _UNITS[unit]
            else:
                value = float(text)
                kind = "fraction" if value <= 1 else "bytes"
        except ValueError:
            raise bad from None
    elif isinstance(budget, float):
        kind, value = "fraction", budget
    elif isinstance(budget, int):
        kind, value = "bytes", budget
    else:
        raise bad
    if not value > 0 or (kind == "fraction" and value > 1):
        raise M2R2Error(f"expert budget {budget!r} must be above 0 and at most 100% of the experts")
    return kind, value


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return ""


def resolve_slots(budget: float | int | str, store: ExpertStore) -> dict[int, int]:
    """Slots per MoE layer for a budget, spread evenly over layers; refuses budgets below top-k."""
    kind, value = parse_budget(budget)
    layers = store.layers
    row = sum(store.expert_bytes(l) for l in layers)  # one slot in every layer
    if kind == "fraction":  # the epsilon keeps exact fractions exact (12.5% of 64 experts = 8 slots)
        slots = {l: min(store.num_experts(l), int(value * store.num_experts(l) + 1e-9)) for l in layers}
    else:
        slots = {l: min(store.num_experts(l), int(value // row)) for l in layers}
    need = {l: store.top_k(l) or 1 for l in layers}
    short = [l for l in layers if slots[l] < need[l]]
    if short:
        l = short[0]
        min_fraction = max(need[l] / store.num_experts(l) for l in layers)
        min_bytes = max(need.values()) * row
        raise M2R2Error(
            f"expert budget {budget!r} holds {slots[l]} of {store.num_experts(l)} experts in layer {l}, but each "
            f"token is routed to {need[l]}: the minimum is {min_fraction:.1%} of the experts "
            f"({min_bytes} bytes, {human(min_bytes)})"
        )
    return slots
