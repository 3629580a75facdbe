"""python -m m2r2_mlx.moe export --model MODEL -o FOLDER [--force] | verify FOLDER
python -m m2r2_mlx.moe adapters --model MODEL -o FOLDER (--text FILE ... | --ids IDS.npy) [--init ADAPTERS]
python -m m2r2_mlx.moe lookahead MODEL [--ids train.npy --heldout heldout.npy] [--lead 3]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)

import numpy as np

from ..core.config import parse_layers
from ..errors import M2R2Error, run_cli
from ..models.registry import load_model
from .lookahead import DEFAULT_FIT, LookaheadFit, train_lookahead
from .router_adapters import RouterAdaptersSpec, train_router_adapters
from .router_target import RouterTargetConfig
from .store import ExpertStore

PROG = "python -m m2r2_mlx.moe"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Expert stores for the MoE expert cache (docs/moe.md).")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser(
        "export", help="write a model's experts to a store folder (read with positional reads at run time)"
    )
    e.add_argument("--model", required=True, help="alias (olmoe), Hugging Face repo id or local MLX folder")
    e.add_argument("-o", "--out", required=True, help="store folder to write")
    e.add_argument("--force", action="store_true", help="replace an existing folder")
    v = sub.add_parser("verify", help="check every expert's checksum in a store folder")
    v.add_argument("folder")
    a = sub.add_parser("adapters", help="train M2R2 adapters on an MoE to predict its routing (docs/moe.md)")
    a.add_argument("--model", required=True, help="an mlx-lm MoE: alias, repo id or folder")
    a.add_argument("-o", "--out", type=Path, required=True, help="adapters folder to write")
    a.add_argument("--text", nargs="+", default=[], metavar="FILE", help="plain text files to train on")
    a.add_argument("--ids", type=Path, default=None, help="or token ids (.npy) to train on")
    a.add_argument("--heldout", type=Path, default=None, help="token ids (.npy) to evaluate on")
    a.add_argument("--init", type=Path, default=None, help="warm start from this adapters folder")
    a.add_argument("--gates", default=None, help="new adapters' gates, comma-separated (default: every --every)")
    a.add_argument("--every", type=int, default=6)
    a.add_argument("--rank", type=int, default=32)
    a.add_argument("--seq-len", type=int, default=128)
    a.add_argument("--tokens", type=int, default=65536, help="most training tokens read")
    a.add_argument("--steps", type=int, default=RouterTargetConfig.steps)
    a.add_argument("--lr", type=float, default=RouterTargetConfig.lr)
    a.add_argument("--batch-size", type=int, default=RouterTargetConfig.batch_size)
    a.add_argument("--temperature", type=float, default=RouterTargetConfig.temperature)
    a.add_argument("--force", action="store_true", help="replace an existing folder")
    k = sub.add_parser("lookahead", help="fit lookahead adapters (MODEL/lookahead.safetensors; docs/moe.md)")
    k.add_argument("model", type=Path, help="an MoE model folder (the adapters are written into it)")
    k.add_argument("--ids", type=Path, default=None, help="training token ids (.npy; default MODEL/train.npy)")
    k.add_argument("--heldout", type=Path, default=None, help="held-out ids (.npy; default MODEL/heldout.npy)")
    k.add_argument("--tokens", type=int, default=DEFAULT_FIT.tokens, help="most training tokens read")
    k.add_argument("--lead", type=int, default=DEFAULT_FIT.lead, help="MoE layers between prediction and use")
    k.add_argument("--depth", type=int, default=DEFAULT_FIT.depth, help="source layers each map reads")
    k.add_argument("--ridge", type=float, default=DEFAULT_FIT.ridge, help="pull towards the target's own router")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        if args.command == "lookahead":
            ids = args.ids or args.model / "train.npy"
            held = args.heldout or args.model / "heldout.npy"
            for path in (ids, held):
                if not path.is_file():
                    raise M2R2Error(f"{path} not found; pass --ids and --heldout token ids (.npy)")
            lm = load_model(str(args.model), tokenizer=False)
            fit = LookaheadFit(lead=args.lead, depth=args.depth, ridge=args.ridge, tokens=args.tokens)
            adapters, record = train_lookahead(lm, np.load(ids), np.load(held), fit)
            print(f"{adapters.save(args.model, record)}: {json.dumps(record)}")
            return
        if args.command == "adapters":
            spec = RouterAdaptersSpec(
                out=args.out,
                text=tuple(args.text),
                ids=args.ids,
                heldout=args.heldout,
                init=args.init,
                gates=parse_layers(args.gates) if args.gates else None,
                every=args.every,
                rank=args.rank,
                seq_len=args.seq_len,
                tokens=args.tokens,
                train=RouterTargetConfig(args.steps, args.lr, args.batch_size, args.temperature),
                force=args.force,
            )
            spec.check()  # before the model loads
            record = train_router_adapters(load_model(args.model), spec)
            before, after = record["before"], record["after"]
            print(
                f"{args.out}: held-out recall of the next interval's experts {before['recall_next_interval']:.1%} -> "
                f"{after['recall_next_interval']:.1%} (pre-gating, next layer: "
                f"{after['pregating_recall_next_layer']:.1%}); loss {record['heldout_loss'][0]:.4f} -> "
                f"{record['heldout_loss'][1]:.4f}"
            )
            return
        if args.command == "export":
            model = load_model(args.model, tokenizer=False).model  # lazy, and each layer released once written
            store = ExpertStore.export(model, args.out, force=args.force, release=True)
        else:
            store = ExpertStore.open(args.folder)
            for layer in store.layers:
                for e in range(store.num_experts(layer)):
                    store.read(layer, e)
        n = sum(store.num_experts(l) for l in store.layers)
        print(
            f"{store.folder}: {len(store.layers)} MoE layers, {n} experts, "
            f"{store.expert_bytes()} bytes per expert, checksums {'written' if args.command == 'export' else 'ok'}"
        )

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
