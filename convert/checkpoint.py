"""PyTorch-trained adapters -> an MLX adapters folder: name mapping, validation against the base, writing.

Two source layouts (docs/convert.md):
  m2r2-pytorch  this project's own names (m2r2_torch/modules.py): ``adapters.{i}.down.weight``,
                ``arla.proj.weight``, ... exactly the MLX parameter names;
  peft-lora     a PEFT LoRA checkpoint (convert/peft.py), which becomes the "lora" adapter form.

What the adapters must look like comes from the M2R2 model itself: a fresh
M2R2Model for the base and the config lists every expected name and shape, so
the checks cannot drift from the model code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from m2r2_mlx.core.adapters import config_for_base, save_adapters
from m2r2_mlx.core.config import CONFIG_FILE, AdapterMetrics, M2R2Config, even_gates
from m2r2_mlx.core.fast_stream import M2R2Model
from m2r2_mlx.errors import M2R2Error

from mlx.utils import tree_flatten

from .peft import looks_like_peft, read_lora_settings, to_m2r2_name, to_peft_name
from .sources import FLOAT_DTYPES, Checkpoint, dtype_name

OWN_LAYOUT = "m2r2-pytorch"
PEFT_LAYOUT = "peft-lora"
DEFAULT_EVERY = 6  # m2r2-train's default gate spacing
_LAYER = re.compile(r"^(?:adapters|lora)\.(\d+)\.")
# the form fields an m2r2_config.json beside an own-layout checkpoint may set
_FORM_FIELDS = (
    "adapter_form",
    "adapter_rank",
    "arla",
    "arla_dim",
    "arla_exit_stats",
    "lora_targets",
    "lora_scale",
    "context_feature",
    "exit_vocab",
)


@dataclass
class Conversion:
    checkpoint: Checkpoint
    layout: str
    m2r2: M2R2Model  # fresh, for the base; receives the converted weights
    targets: dict[str, str]  # source name -> M2R2 parameter name

    @property
    def config(self) -> M2R2Config:
        return self.m2r2.config

    def source_of(self, target: str) -> str:
        return to_peft_name(target) if self.layout == PEFT_LAYOUT else target

    def rows(self) -> list[tuple[str, str, tuple[int, ...], str]]:
        """(source name, target name, shape, source dtype), in the order of the M2R2 parameters."""
        by_target = {t: s for s, t in self.targets.items()}
        out = []
        for target, _ in tree_flatten(self.m2r2.parameters()):
            source = by_target[target]
            array = self.checkpoint.tensors[source]
            out.append((source, target, tuple(array.shape), dtype_name(array)))
        return out


def plan_conversion(ckpt: Checkpoint, lm, gates: list[int] | None = None, every: int | None = None) -> Conversion:
    """Map and validate every tensor of ``ckpt`` against adapters for the base ``lm``; raise on the first fault."""
    names = list(ckpt.tensors)
    beside = _config_beside(ckpt.folder, lm)
    gates = _choose_gates(beside, gates, every, len(lm.model.layers))
    if looks_like_peft(ckpt.folder, names):
        layout = PEFT_LAYOUT
        lora = read_lora_settings(ckpt.folder, names)
        fields = {
            "adapter_form": "lora",
            "adapter_rank": lora.rank,
            "lora_targets": lora.targets,
            "lora_scale": lora.scale,
        }
        targets = {n: to_m2r2_name(n) for n in names}
        _check_lora_rank(ckpt, targets, lora.rank)
    else:
        layout = OWN_LAYOUT
        fields = {k: getattr(beside, k) for k in _FORM_FIELDS} if beside else _infer_own_form(ckpt, gates)
        targets = {n: n for n in names}
    # a config beside the checkpoint carries what its trainer measured and recorded
    metrics = beside.metrics if beside else AdapterMetrics()
    extra = {**(beside.extra if beside else {}), "converted_from": str(ckpt.path), "source_layout": layout}
    m2r2 = M2R2Model(lm.model, config_for_base(lm, gates, metrics=metrics, extra=extra, **fields))
    conversion = Conversion(ckpt, layout, m2r2, targets)
    _validate(conversion)
    return conversion


def write_conversion(
    conversion: Conversion, out: str | Path, dtype: str = "float32", force: bool = False, keep: tuple[str, ...] = ()
) -> Path:
    """Cast to ``dtype`` and write the adapters folder atomically (save_adapters); refuses an existing
    folder unless ``force``; ``keep``: entries of the existing folder to carry over (m2r2-train-torch's data)."""
    weights = [(t, conversion.checkpoint.tensors[s].astype(FLOAT_DTYPES[dtype])) for s, t in conversion.targets.items()]
    conversion.m2r2.load_weights(weights, strict=True)
    conversion.config.extra["dtype"] = dtype
    return save_adapters(conversion.m2r2, out, overwrite=force, keep=keep)


def format_table(conversion: Conversion, dtype: str) -> str:
    """The name mapping as an aligned text table, with a summary line."""
    header = ("source name", "target name", "shape", "dtype")
    rows = [
        (s, t, "x".join(map(str, shape)), d if d == dtype else f"{d} -> {dtype}")
        for s, t, shape, d in conversion.rows()
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    cfg = conversion.config
    count = sum(conversion.checkpoint.tensors[s].size for s, *_ in conversion.rows())
    form = (
        f"lora on {','.join(cfg.lora_targets)}, scale {cfg.lora_scale:g}"
        if cfg.adapter_form == "lora"
        else cfg.adapter_form
    )
    lines.append(
        f"{len(rows)} tensors, {count:,} parameters: {conversion.layout} -> {form}, rank {cfg.adapter_rank}, "
        f"gates {cfg.gates}{', ARLA ' + str(cfg.arla_dim) if cfg.arla else ''}, base {cfg.base_model}"
    )
    return "\n".join(lines)


# ---- what the adapters are for ---------------------------------------------------------


def _config_beside(folder: Path, lm) -> M2R2Config | None:
    """An m2r2_config.json next to the checkpoint (gates, form), checked against the base's shape.

    Its base hash is not compared: a PyTorch-side config hashes the Hugging Face config,
    which need not equal the MLX folder's; layer count and width must agree.
    """
    if not (folder / CONFIG_FILE).is_file():
        return None
    cfg = M2R2Config.load(folder)
    layers, hidden = len(lm.model.layers), int(lm.model.args.hidden_size)
    if (cfg.num_layers, cfg.hidden_size) != (layers, hidden):
        raise M2R2Error(
            f"{folder / CONFIG_FILE} is for a base with {cfg.num_layers} layers of width {cfg.hidden_size}, "
            f"not {lm.name!r} ({layers} layers of width {hidden}); check --base"
        )
    return cfg


def _choose_gates(beside: M2R2Config | None, gates: list[int] | None, every: int | None, num_layers: int) -> list[int]:
    asked = gates or (even_gates(num_layers, every) if every else None)
    if beside is not None:
        if asked and asked != beside.gates:
            raise M2R2Error(
                f"gates {asked} disagree with {CONFIG_FILE} beside the checkpoint ({beside.gates}); drop "
                "--gates/--every"
            )
        return beside.gates
    if asked:
        return asked
    if num_layers <= DEFAULT_EVERY:
        raise M2R2Error(
            f"the base has {num_layers} layers, too few for the default gate every {DEFAULT_EVERY}; pass --gates"
        )
    return even_gates(num_layers, DEFAULT_EVERY)


def _infer_own_form(ckpt: Checkpoint, gates: list[int]) -> dict:
    """Bottleneck rank (one, or one per gate interval) and ARLA width from the tensors' shapes (no config
    beside the checkpoint)."""
    if any(n.startswith("lora.") for n in ckpt.tensors):
        raise M2R2Error(
            f"{ckpt.path.name} holds lora.* weights in this project's layout; put the m2r2_config.json "
            "they were trained with beside it (it names the targets and scale)"
        )
    ranks = [_dim(ckpt, f"adapters.{start}.down.weight", 0) for start in [0, *gates[:-1]]]
    fields = {"adapter_rank": ranks[0] if len(set(ranks)) == 1 else ranks}
    if any(n.startswith("arla.") for n in ckpt.tensors):
        fields.update(
            arla=True,
            arla_dim=_dim(ckpt, "arla.proj.weight", 0),
            arla_exit_stats="arla.exit_proj.weight" in ckpt.tensors,
        )
    return fields


def _dim(ckpt: Checkpoint, name: str, axis: int) -> int:
    if name not in ckpt.tensors:
        raise M2R2Error(f"missing key {name!r} in {ckpt.path.name}; it is needed to read the adapters' size")
    return int(ckpt.tensors[name].shape[axis])


def _check_lora_rank(ckpt: Checkpoint, targets: dict[str, str | None], rank: int) -> None:
    for source, target in targets.items():
        if (
            target
            and target.endswith(".lora_a.weight")
            and ckpt.tensors[source].ndim == 2
            and ckpt.tensors[source].shape[0] != rank
        ):
            raise M2R2Error(
                f"{source!r} has rank {ckpt.tensors[source].shape[0]}, but adapter_config.json says r={rank}; "
                "the config and the weights come from different runs"
            )


# ---- validation ------------------------------------------------------------------------


def _validate(conv: Conversion) -> None:
    """Every tensor maps to an expected parameter, every parameter is given once, every shape fits."""
    expected = dict(tree_flatten(conv.m2r2.parameters()))
    cfg, tensors, file = conv.config, conv.checkpoint.tensors, conv.checkpoint.path.name
    unknown = [s for s, t in conv.targets.items() if t not in expected]
    if unknown:
        raise M2R2Error(f"unknown key {unknown[0]!r}{_more(unknown)} in {file}: {_why_unknown(conv, unknown[0])}")
    seen: dict[str, str] = {}
    for source, target in conv.targets.items():
        if target in seen:
            raise M2R2Error(f"keys {seen[target]!r} and {source!r} in {file} both give {target}; keep one")
        seen[target] = source
    missing = [t for t in expected if t not in seen]
    if missing:
        names = repr(conv.source_of(missing[0])) + (
            "" if conv.source_of(missing[0]) == missing[0] else f" (M2R2 {missing[0]})"
        )
        raise M2R2Error(f"missing key {names}{_more(missing)} in {file}: adapters for gates {cfg.gates} need it")
    for source, target in conv.targets.items():
        have, want = tuple(tensors[source].shape), tuple(expected[target].shape)
        if have != want:
            raise M2R2Error(
                f"key {source!r} in {file} has shape {have}, expected {want} "
                f"({_sizes(cfg)}); the checkpoint was made for another base or size"
            )


def _why_unknown(conv: Conversion, source: str) -> str:
    target = conv.targets[source]
    last = conv.config.gates[-1]
    if target is None:
        return "not a decoder layer's LoRA weight (base_model.model.model.layers.N.<module>.lora_A/lora_B.weight)"
    m = _LAYER.match(target)
    if m and int(m[1]) >= last:
        return (
            f"layer {m[1]} is past the last gate ({last}), where the fast stream stops; "
            "pass the gates the adapters were trained for (--gates)"
        )
    if conv.layout == PEFT_LAYOUT:
        return f"not one of the LoRA targets {conv.config.lora_targets} of the base's layers"
    return f"not an M2R2 adapter weight (expected names: adapters.N.norm/down/up.weight for N < {last}, arla.*)"


def _sizes(cfg: M2R2Config) -> str:
    return f"hidden {cfg.hidden_size}, rank {cfg.adapter_rank}" + (f", ARLA {cfg.arla_dim}" if cfg.arla else "")


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""
