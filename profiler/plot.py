"""A stacked bar per profiled mode: where a decode step's time goes, in ms per token so modes that emit several
tokens a step compare with plain decoding. Drawn from every summary in the output folder, so profiling each mode
into one folder builds the comparison. matplotlib is imported only here (the profile, bench and test extras install
it); without it the profile is written all the same, less the PNG."""

from __future__ import annotations

import json
from pathlib import Path

from m2r2_mlx.atomic import atomic_save_figure
from m2r2_mlx.decoding.methods import METHODS

# component kind -> the plot's category (a few colours read better than every row)
CATEGORIES = {
    "attention": "attention",
    "mlp": "feed-forward / experts' block",
    "head": "LM heads",
    "draft-head": "LM heads",
    "exit-head": "LM heads",
    "embed": "embedding, adapters, exit decision",
    "adapter": "embedding, adapters, exit decision",
    "exit-rule": "embedding, adapters, exit decision",
    "sample": "sampling and acceptance",
    "accept": "sampling and acceptance",
    "expert-stall": "expert loads",
}
BOOKKEEPING = "engine bookkeeping (planning, lookup, masks)"
OVERHEAD = "framework and Python overhead"
ORDER = [*dict.fromkeys(CATEGORIES.values()), BOOKKEEPING, OVERHEAD]


def category(row: dict) -> str:
    kind = row["component"].partition(":")[0]
    if kind:
        return CATEGORIES[kind]
    return OVERHEAD if row["phase"] == "step" else BOOKKEEPING


def summaries(folder: Path) -> list[dict]:
    """The folder's profiles: dense models before budgeted ones, by model, in the method table's order."""
    found = [json.loads(p.read_text()) for p in folder.glob("profile-*.json")]
    order = list(METHODS)
    rank = lambda s: order.index(s["label"].split()[0]) if s["label"].split()[0] in order else len(order)
    return sorted(found, key=lambda s: (bool(s["experts"]), s["model"], rank(s), s["label"]))


NO_MATPLOTLIB = "no profile.png: the plot needs matplotlib (pip install 'm2r2-mlx[profile]' or matplotlib)"


def plot(folder: Path, path: Path) -> Path | None:
    """The PNG at ``path``; None where matplotlib is not installed (the report and trace need none of it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    found = summaries(folder)
    models = {s["model"] for s in found}
    names = [s["label"] if len(models) == 1 else f"{s['model']}\n{s['label']}" for s in found]
    fig, ax = plt.subplots(figsize=(5.5 + 1.3 * len(found), 4.8), layout="constrained")
    bottoms = [0.0] * len(found)
    colours = plt.get_cmap("tab10")
    for c, name in enumerate(ORDER):
        heights = [
            sum(r["ms_per_step"] for r in s["rows"] if category(r) == name) / max(s["tokens_per_step"], 1e-9)
            for s in found
        ]
        if any(heights):
            ax.bar(names, heights, bottom=bottoms, label=name, color=colours(c))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, (s, top) in enumerate(zip(found, bottoms)):
        ax.annotate(f"{s['tokens_per_step']:.2f} tok/step", (x, top), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per token (measured run)")
    ax.set_title(f"Where a decode step's time goes: {', '.join(sorted(models))}")
    fig.legend(fontsize=7, loc="outside right upper")
    atomic_save_figure(fig, path)
    plt.close(fig)
    return path
