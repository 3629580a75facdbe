"""When does a draft pay for itself? Draft acceptance by confidence, beside what drafting and verifying cost.

    python -m experiments.draft_calibration --categories all --limit 1 --max-tokens 64

One draft per verification step (max draft 1, no threshold), greedy, on Spec-Bench first turns:
for every step, the draft's probability under the fast stream's exit and whether the full model
accepted it. Beside it, on this machine, the cost of one draft step and of verifying k tokens
in one forward, as multiples of a plain one-token step (medians). A draft at confidence c is
worth verifying when its acceptance rate exceeds the cost of one more verified position; the
threshold should sit where the curve crosses that line. From the same steps and costs: the expected
speedup of each threshold, beside an oracle that knows beforehand which steps will draft surely (the
bound on any "should I draft now?" signal), and the ceiling if every draft were accepted. Writes a
markdown table and a PNG.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_save_figure, atomic_write_text
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.draft import Draft
from m2r2_mlx.decoding.methods import fast_drafter
from m2r2_mlx.decoding.planner import VerifyAll
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.decoding.protocols import DraftRequest
from m2r2_mlx.decoding.sampling import Sampling
from m2r2_mlx.decoding.speculative import Speculator, SpeculatorSettings
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.tracing import Tracer

import mlx.core as mx
from tqdm.auto import tqdm

from m2r2_bench.questions import SPECBENCH, select_questions

EDGES = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0001]


class Watch(Tracer):
    """Before each draft: the full model's probability of the token the draft follows (the last forward's row after
    the drafts it accepted, or the prefill's last row before the first step), and the drafter's first draft's."""

    def __init__(self, drafter, stats: AnswerStats):
        self.drafter, self.stats, self.logits = drafter, stats, None
        self.confs: list[float | None] = []
        self.before: list[float] = []

    def call(self, kind, fn, *args, **kwargs):
        if kind == "draft":
            draft, cache = args[0], args[1].cache
            row = self.stats.accept_lengths[-1] - 1 if self.stats.accept_lengths else -1
            self.before.append(mx.softmax(self.logits[row].astype(mx.float32)).max().item())
            self.confs.append(first_draft_probability(self.drafter, cache, draft.tokens[-1]))
        out = fn(*args, **kwargs)
        if kind == "forward":
            self.logits = out
        return out


def acceptance_by_confidence(lm, drafter, questions, max_tokens: int) -> tuple[list[tuple[float, bool]], list]:
    """(first draft's probability, accepted?) for every verification step; beside them, what is known before the
    draft is paid for: (the full model's probability of the token the draft follows, was the previous step's
    draft accepted?, accepted?)."""
    pairs, signals = [], []
    for q in tqdm(questions, desc="drafting", unit="question"):
        prompt = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True
        )
        watch = Watch(drafter, AnswerStats())
        cache, stats = PromptCache(lm.model, tracer=watch), watch.stats
        engine = Speculator(lm.model, lm.tokenizer, [drafter], VerifyAll([drafter]), SpeculatorSettings(1), watch)
        for ev in engine(prompt, cache, GenerationConfig(max_tokens)):  # each step's length is known (its last
            stats.add(ev)  # event read) before the next step drafts
        confs, before = watch.confs, watch.before
        accepted = [n > 1 for n in stats.accept_lengths]
        pairs += [(c, a) for c, a in zip(confs, accepted) if c is not None]
        signals += [(p, prev, a) for p, prev, a, c in zip(before, [None] + accepted, accepted, confs) if c is not None]
    return pairs, signals


def first_draft_probability(drafter, cache, token: int) -> float:
    """The probability of the drafter's first draft after ``token`` (its draft step run once more, the cache left
    as it was)."""
    h_prev = cache.states[-1] if drafter.keeps_states and cache.states is not None else None
    args = (drafter.gate_index, cache.layers, drafter.head, drafter.adapters, h_prev)
    probs = mx.softmax(drafter.m2r2.draft_logits(mx.array(token), *args).astype(mx.float32))
    for layer in cache.layers[: drafter.exit_layer]:
        layer.trim(1)
    return probs.max().item()


def draft_step(drafter, cache, token: int) -> None:
    """One draft step after ``token``, the cache left as it was."""
    drafter.propose(Draft.root(token), DraftRequest(cache, (), 1, Sampling(), set()))


def step_costs(lm, drafter, ks=(2, 3, 4, 6, 8), repeats: int = 21) -> dict:
    """A plain one-token step (ms), then a draft step and k-token forwards as multiples of it: medians over
    rounds that time every kind once, side by side, so drift on a shared machine hits them alike."""
    cache = PromptCache(lm.model)
    cache.keep_states = drafter.keeps_states  # as speculative decoding runs it: a context feature's draft reads them
    mx.eval(cache.forward(lm.tokenizer.encode("The history of the city begins with a small harbour. " * 12)))

    def forward(k: int):
        mx.eval(cache.forward([42] * k))
        cache.trim(k)

    kinds = {
        "plain": lambda: forward(1),
        "draft step": lambda: draft_step(drafter, cache, 42),
        **{f"verify {k} tokens": (lambda k=k: forward(k)) for k in ks},
    }
    times = {name: [] for name in kinds}
    for _ in range(repeats):
        for name, fn in kinds.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    one = statistics.median(times.pop("plain"))
    return {"plain step ms": one * 1e3, **{name: statistics.median(ts) / one for name, ts in times.items()}}


def buckets(pairs, edges=EDGES) -> list[tuple[float, float, int, float]]:
    """(low, high, steps, acceptance rate) per non-empty bucket of ``edges``, from (value, accepted?) pairs."""
    out = []
    for lo, hi in zip(edges, edges[1:]):
        hits = [a for c, a in pairs if lo <= c < hi]
        if hits:
            out.append((lo, min(hi, 1.0), len(hits), sum(hits) / len(hits)))
    return out


def table(pairs, costs) -> list[str]:
    extra = costs["verify 2 tokens"] - 1.0  # one more verified position
    lines = [
        "| draft probability | steps | accepted | worth verifying (accepted > %.2f) |" % extra,
        "|---|---|---|---|",
    ]
    for lo, hi, n, rate in buckets(pairs):
        lines.append(f"| {lo:.1f}-{hi:.1f} | {n} | {rate:.0%} | {'yes' if rate > extra else 'no'} |")
    total = sum(a for _, a in pairs) / len(pairs)
    lines.append(f"| all | {len(pairs)} | {total:.0%} | |")
    need = costs["draft step"] + extra
    expected = policy_speedups(pairs, costs, thresholds=(0.0,))[0][3]  # every draft verified
    lines += [
        "",
        f"One draft per step pays on average only if it is accepted more often than a draft step plus one "
        f"verified position cost: {need:.2f} here; measured {total:.0%}, so drafting "
        f"{'pays' if total > need else 'does not pay'} (expected {expected:.2f}x plain).",
    ]
    return lines


def policy_speedups(
    pairs, costs, thresholds=(0.0, 0.2, 0.3, 0.4, 0.5)
) -> list[tuple[float, float, float, float, float]]:
    """Expected speedup over plain of one draft per step, from the measured steps and costs, per threshold t:
    (t, share of steps whose draft reaches t, their acceptance, drafting every step and verifying only the
    drafts that reach t, an oracle that knows beforehand which steps those are and drafts only there).
    The oracle bounds any signal that decides whether to draft before paying for the draft."""
    d, v2 = costs["draft step"], costs["verify 2 tokens"]
    n, out = len(pairs), []
    for t in thresholds:
        sure = [a for c, a in pairs if c >= t]
        m, gained = len(sure), sum(sure)
        every = (n + gained) / (n * d + m * v2 + (n - m))
        oracle = (n + gained) / (m * (d + v2) + (n - m))
        out.append((t, m / n, gained / m if m else 0.0, every, oracle))
    return out


def ceilings(costs) -> list[tuple[int, float]]:
    """(drafts per step, speedup) if every draft were accepted: k drafts cost k draft steps and a (k+1)-token
    verification; only the verification sizes measured."""
    return [(k - 1, k / ((k - 1) * costs["draft step"] + cost)) for k, cost in verify_costs(costs)]


def verify_costs(costs) -> list[tuple[int, float]]:
    """(tokens verified in one forward, its cost in plain steps), for the sizes measured, smallest first."""
    return sorted((int(name.split()[1]), cost) for name, cost in costs.items() if name.startswith("verify "))


def signal_table(signals) -> list[str]:
    """Acceptance by what is known before drafting: the full model's probability of the token the draft follows,
    and whether the previous step's draft was accepted. A signal worth a pre-draft gate would split the steps
    into some far above the break-even acceptance and some far below."""
    lines = ["| known before drafting | steps | accepted |", "|---|---|---|"]
    for lo, hi, n, rate in buckets([(p, a) for p, _, a in signals], edges=[0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0001]):
        lines.append(f"| full model's probability of the last token {lo:.2f}-{hi:.2f} | {n} | {rate:.0%} |")
    for prev, label in ((True, "accepted"), (False, "rejected")):
        hits = [a for _, p, a in signals if p is prev]
        if hits:
            lines.append(f"| previous step's draft {label} | {len(hits)} | {sum(hits) / len(hits):.0%} |")
    return lines


def acceptance_needed(costs, tokens_per_step: float = 3.0, speedup: float = 2.0) -> list[tuple[int, float, float]]:
    """(drafts per step k, per-draft acceptance for ``tokens_per_step``, for ``speedup`` over plain) with every step
    drafting k and each draft accepted with the same probability a after an accepted one: a step yields
    1 + a + ... + a^k tokens and costs k draft steps and a (k+1)-token verification (only those measured).
    nan: out of reach even with every draft accepted."""

    def solve(goal) -> float:
        if goal(1.0) < 0:
            return float("nan")
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if goal(mid) >= 0 else (mid, hi)
        return hi

    out = []
    for verified, cost in verify_costs(costs):
        k = verified - 1
        tokens = lambda a, k=k: sum(a**i for i in range(k + 1))
        step = k * costs["draft step"] + cost
        out.append((k, solve(lambda a: tokens(a) - tokens_per_step), solve(lambda a: tokens(a) / step - speedup)))
    return out


def policy_table(pairs, costs) -> list[str]:
    lines = [
        "| verify the draft when its probability is at least | steps | their acceptance | "
        "speedup, drafting every step | speedup, drafting only those steps (oracle) |",
        "|---|---|---|---|---|",
    ]
    for t, share, rate, every, oracle in policy_speedups(pairs, costs):
        lines.append(f"| {t:.1f} | {share:.0%} | {rate:.0%} | {every:.2f}x | {oracle:.2f}x |")
    best = ", ".join(f"{k} draft{'s' if k > 1 else ''} {x:.2f}x" for k, x in ceilings(costs))
    lines += [
        "",
        "The oracle column bounds any signal that says, before drafting, whether this step's draft will be "
        "sure: it saves the draft steps that buy nothing, and no more. With every draft accepted, the "
        f"measured costs allow at most: {best}.",
        "",
        "Per-draft acceptance needed, every step drafting k (each draft accepted with the same probability "
        "after an accepted one):",
        "",
        "| drafts per step | for 3.0 tokens per step | for 2.0x plain |",
        "|---|---|---|",
    ]
    pct = lambda a: "out of reach" if a != a else f"{a:.0%}"
    lines += [f"| {k} | {pct(t)} | {pct(x)} |" for k, t, x in acceptance_needed(costs)]
    return lines


def plot(pairs, costs, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = buckets(pairs)
    mids, rates, ns = [(lo + hi) / 2 for lo, hi, _, _ in rows], [r for *_, r in rows], [n for _, _, n, _ in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(mids, rates, "o-", label="acceptance of the draft")
    for x, y, n in zip(mids, rates, ns):
        ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.axhline(costs["verify 2 tokens"] - 1, color="tab:red", ls="--", label="cost of one more verified position")
    ax.axhline(costs["draft step"], color="tab:gray", ls=":", label="cost of a draft step")
    ax.plot([0, 1], [0, 1], color="lightgray", lw=0.8, label="perfect calibration")
    ax.set(xlabel="draft probability at the gate", ylabel="accepted / cost (plain steps)", xlim=(0, 1), ylim=(0, 1))
    ax.legend(fontsize=8)
    ax.set_title("Is a draft worth verifying?", fontsize=10)
    fig.tight_layout()
    atomic_save_figure(fig, out)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.draft_calibration", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapters", default=None)
    ap.add_argument("--gate", type=int, default=None, help="draft exit layer (default: the first gate)")
    ap.add_argument("--questions", type=Path, default=SPECBENCH, help="Spec-Bench question.jsonl")
    ap.add_argument("--categories", default="all")
    ap.add_argument("--limit", type=int, default=1, help="questions per category")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("build/draft_calibration.md"))
    return ap


def _main() -> int:
    args = build_parser().parse_args()

    lm = load_model(args.model)
    drafter = fast_drafter(lm, DecodeConfig(gate=args.gate), args.adapters, threshold=0.0)
    questions = select_questions(args.questions, args.categories, args.limit)
    costs = step_costs(lm, drafter)
    pairs, signals = acceptance_by_confidence(lm, drafter, questions, args.max_tokens)
    cost_line = ", ".join(f"{k} {v:.2f}x" for k, v in costs.items() if k != "plain step ms")
    lines = [
        "# Draft calibration\n",
        f"`python -m experiments.draft_calibration {' '.join(sys.argv[1:])}`: {drafter.name}, {len(questions)} "
        "Spec-Bench "
        f"first turns ({args.categories}), one draft per step, greedy, float32, {blas_info().name} BLAS.\n",
        f"Cost as multiples of a plain one-token step (medians of 21 interleaved rounds): {cost_line}.\n",
        *table(pairs, costs),
        "",
        "## What a drafting policy can reach\n",
        *policy_table(pairs, costs),
        "",
        "## Signals known before drafting\n",
        *signal_table(signals),
        "",
        f"![acceptance by draft probability]({args.out.with_suffix('.png').name})",
    ]
    text = "\n".join(lines) + "\n"
    atomic_write_text(args.out, text)
    plot(pairs, costs, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("experiments.draft_calibration", _main))
