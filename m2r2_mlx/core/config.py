"""M2R2Config: what an adapters folder was trained for, saved as m2r2_config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import M2R2Error

CONFIG_FILE = "m2r2_config.json"
ADAPTERS_FILE = "adapters.safetensors"
PACKAGED = Path(__file__).resolve().parents[1] / "trained"  # the adapters the package ships, a folder per model

# How the fast stream departs from the base in each layer it runs:
#   parallel_bottleneck: h <- layer(h) + up(silu(down(rmsnorm(h))))
#   lora: the layer's targeted projections W become W + lora_scale * B A, in the fast stream only
ADAPTER_FORMS = ("parallel_bottleneck", "lora")


@dataclass
class AdapterMetrics:
    """What the adapters' trainer measured on held-out tokens. Decoding reads it: the speculative engine's
    starting acceptance rates, and the exit rule early exit uses."""

    # gates, and per gate the share of held-out tokens whose exit there agrees with the full model: "fast" (the
    # fast stream's exit) and "layerskip" (the slow state's own); tokens scored
    heldout_agreement: dict = field(default_factory=dict)
    # gates, and "auc": per exit rule ("confidence", "arla", ...) the ROC AUC per gate of telling right from wrong
    # exits
    exit_auc: dict = field(default_factory=dict)

    KEYS = ("heldout_agreement", "exit_auc")
    LEGACY = {"m2r2": "fast", "naive": "layerskip"}  # the names folders written before 6978afe use

    def __post_init__(self):
        rename = lambda d: {self.LEGACY.get(k, k): v for k, v in d.items()}  # noqa: E731
        self.heldout_agreement = rename(self.heldout_agreement)
        if isinstance(self.heldout_agreement.get("scored"), dict):
            self.heldout_agreement["scored"] = rename(self.heldout_agreement["scored"])

    def agreement(self, exit_layer: int, adapters: bool = True) -> float | None:
        """The held-out agreement of the exit at ``exit_layer``, the fast stream's (``adapters``) or layerskip's;
        None if not measured."""
        rates = self.heldout_agreement.get("fast" if adapters else "layerskip") or []
        gates = self.heldout_agreement.get("gates", [])
        return rates[gates.index(exit_layer)] if exit_layer in gates and len(rates) == len(gates) else None

    def exit_auc_sum(self, rule: str) -> float | None:
        """The summed ROC AUC over gates of an exit rule ("arla", "confidence"); None if not measured."""
        auc = self.exit_auc.get("auc", {}).get(rule)
        return sum(auc) if auc else None


def parse_layers(text: str, flag: str = "--gates") -> tuple[int, ...]:
    """Layer numbers from a flag's text (``6,12,18``); one line naming ``flag`` otherwise."""
    try:
        return tuple(int(g) for g in text.split(","))
    except ValueError:
        raise M2R2Error(f"{flag} takes comma-separated layer numbers, e.g. 6,12,18 (got {text!r})") from None


def even_gates(num_layers: int, every: int) -> list[int]:
    """Gates every ``every`` layers, excluding the last layer (that exit is the base model's own)."""
    return [g for g in range(every, num_layers, every)]


@dataclass
class M2R2Config:
    gates: list[int]  # exit layers g_1 < ... < g_J (1-based layer counts: an exit after g layers)
    num_layers: int
    hidden_size: int
    adapter_form: str = "parallel_bottleneck"  # one of ADAPTER_FORMS
    adapter_rank: int | list[int] = 64  # one bottleneck rank for every fast-stream layer, or one per gate interval
    arla_dim: int = 64
    arla: bool = False  # the folder holds ARLA exit-decision weights (arla.*)
    arla_exit_stats: bool = False  # ARLA's latents also read the exit distribution's statistics (arla.exit_proj)
    # Exits are scored over the first exit_vocab tokens of draft_vocab.json (the most frequent ones), as ARLA
    # was trained: a check then reads 4,096 rows of the LM head, not all of them. 0: the full vocabulary.
    exit_vocab: int = 0
    # The first interval's fast stream starts from the token's embedding plus a learned projection of the
    # previous position's final residual (fast_stream.ContextFeature): its six shallow layers otherwise see
    # the context only through shallow keys and values.
    context_feature: bool = False
    lora_targets: list[str] = field(default_factory=list)  # "lora" form: projection names (q_proj, qkv_proj, ...)
    lora_scale: float = 1.0  # "lora" form: delta = lora_scale * B(A(x)), PEFT's lora_alpha / r
    base_model: str = ""
    base_config_hash: str = ""
    metrics: AdapterMetrics = field(default_factory=AdapterMetrics)
    extra: dict = field(default_factory=dict)  # the training recipe, timings: informational, never read to decode

    def __post_init__(self):
        g = self.gates
        if not g or g != sorted(set(g)) or g[0] < 1 or g[-1] >= self.num_layers:
            raise M2R2Error(f"gates {g} must be increasing layer counts in 1..{self.num_layers - 1}")
        if self.adapter_form not in ADAPTER_FORMS:
            raise M2R2Error(
                f"adapter form {self.adapter_form!r} is unknown; this version has {', '.join(map(repr, ADAPTER_FORMS))}"
            )
        if (self.adapter_form == "lora") != bool(self.lora_targets):
            raise M2R2Error(
                "lora_targets (the projections LoRA adapts) must be given for the 'lora' adapter form, and only for it"
            )
        ranks = self.adapter_rank if isinstance(self.adapter_rank, list) else [self.adapter_rank]
        if isinstance(self.adapter_rank, list) and (len(ranks) != len(g) or self.adapter_form == "lora"):
            raise M2R2Error(
                f"adapter ranks {ranks} must be one per gate interval ({len(g)} gates), bottleneck form only"
            )
        if min(ranks) < 1:
            raise M2R2Error(f"adapter rank must be at least 1 (got {self.adapter_rank})")

    def intervals(self) -> list[tuple[int, int]]:
        """(start, stop) layer ranges the fast stream covers: [g_(j-1), g_j) with g_0 = 0."""
        starts = [0] + self.gates[:-1]
        return list(zip(starts, self.gates))

    def layer_ranks(self) -> list[int]:
        """The bottleneck rank of each fast-stream layer 0..gates[-1]-1."""
        if not isinstance(self.adapter_rank, list):
            return [self.adapter_rank] * self.gates[-1]
        return [r for (start, stop), r in zip(self.intervals(), self.adapter_rank) for _ in range(start, stop)]

    def save(self, folder: Path) -> None:
        (Path(folder) / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, folder: Path) -> "M2R2Config":
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise M2R2Error(f"{folder} has no {CONFIG_FILE}; it is not an M2R2 adapters folder")
        try:
            data = json.loads(path.read_text())
            data.pop("integrity", None)  # the files' hashes (core/integrity.py): checked before loading, not kept
            extra = dict(data.pop("extra", None) or {})
            # files written before metrics had a field of their own kept them in "extra"
            metrics = data.pop("metrics", None) or {k: extra.pop(k) for k in AdapterMetrics.KEYS if k in extra}
            return cls(**data, metrics=AdapterMetrics(**metrics), extra=extra)
        except (TypeError, ValueError, AttributeError) as e:
            raise M2R2Error(f"{path} is not a valid M2R2 config ({e})") from None
