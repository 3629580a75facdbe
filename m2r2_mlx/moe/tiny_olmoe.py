"""A small OLMoE, trained from scratch on package corpora: the MoE model the expert cache is measured on.

No trained MoE ships in a package, so this builds one reproducibly, in three steps:

    python -m m2r2_mlx.moe.tiny_olmoe data  -o build/olmoe-data    # corpus + BPE tokenizer + token ids (CPU, ~1 min)
    python -m m2r2_mlx.moe.tiny_olmoe train --data build/olmoe-data -o build/olmoe-torch --device cuda
    python -m m2r2_mlx.moe.tiny_olmoe export build/olmoe-torch --data build/olmoe-data -o build/tiny-olmoe

Training is PyTorch (an MLX model of this size trains at ~300 tokens/s on a 2-core CPU,
far too slow to learn routing; a GPU, or Apple's MPS, does it in minutes). The PyTorch
module below is mlx-lm's ``olmoe`` written out (QK-norm attention, non-traditional RoPE,
softmax top-k router without renormalisation, SwiGLU experts), with the same weight
names, so ``export`` only stacks nothing, casts and writes: mlx-lm loads the folder as is.
A test checks the two forwards agree on a random tiny config.

Experts are computed densely with a routing mask while training (identical maths and
gradients to the sparse gather; far faster on a GPU at this size); the Switch
load-balancing loss and the router z-loss keep experts in use, as OLMoE does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm

from ..atomic import atomic_folder, refuse_existing
from ..errors import M2R2Error, run_cli
from ..training.corpora import _package_dir, fortunes

# 8 layers x 32 experts (top-4) of 96 hidden units: ~25M parameters, experts ~76% of the bytes.
CONFIG = dict(
    model_type="olmoe",
    vocab_size=8192,
    hidden_size=256,
    num_hidden_layers=8,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=False,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}"


# ---------------------------------------------------------------- data
def corpus_documents() -> list[str]:
    """Shakespeare's plays, fortunes and the Python 3.11 documentation sources, as documents."""
    docs = [f.read_text(errors="replace") for f in sorted((_package_dir("shksprdata") / "texts").glob("*_gut.txt"))]
    docs += fortunes()
    pydoc = Path("/usr/share/doc/python3.11/html/_sources")
    if not pydoc.is_dir():
        raise M2R2Error(f"{pydoc} not found; install it with: apt-get install python3.11-doc")
    docs += [f.read_text(errors="replace") for f in sorted(pydoc.rglob("*.txt"))]
    return docs


def build_data(out: Path, vocab_size: int, holdout: float = 0.01, seed: int = 0) -> dict:
    """Train a byte-level BPE on the corpus, encode it, split off held-out documents."""
    docs = corpus_documents()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(docs))
    n_eval = max(1, int(len(docs) * holdout))
    eval_docs, train_docs = [docs[i] for i in order[:n_eval]], [docs[i] for i in order[n_eval:]]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(train_docs, trainer=trainer)
    eos = tok.token_to_id(SPECIALS[0])

    def encode(ds):
        ids = [np.array(e.ids + [eos], dtype=np.uint16) for e in tok.encode_batch(ds)]
        return np.concatenate(ids)

    train_ids, eval_ids = encode(train_docs), encode(eval_docs)
    with atomic_folder(out) as tmp:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "eos_token": SPECIALS[0],
                    "pad_token": SPECIALS[0],
                    "model_max_length": CONFIG["max_position_embeddings"],
                    "chat_template": CHAT_TEMPLATE,
                },
                indent=1,
            )
        )
        np.save(tmp / "train.npy", train_ids)
        np.save(tmp / "eval.npy", eval_ids)
    return {"documents": len(docs), "train_tokens": int(train_ids.size), "eval_tokens": int(eval_ids.size)}


# ---------------------------------------------------------------- the PyTorch model (mlx-lm olmoe, written out)
def torch_model(config: dict):
    import torch
    import torch.nn.functional as F
    from torch import nn

    c = config
    head_dim = c["hidden_size"] // c["num_attention_heads"]

    class RMSNorm(nn.Module):
        def __init__(self, dims):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dims))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"])).type_as(x) * self.weight

    def rope(x, positions):  # non-traditional: rotate the two halves of each head
        half = head_dim // 2
        freqs = c["rope_theta"] ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
        angles = positions[:, None].float() * freqs[None]
        cos, sin = angles.cos().type_as(x), angles.sin().type_as(x)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            d, h, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
            self.q_proj = nn.Linear(d, h * head_dim, bias=False)
            self.k_proj = nn.Linear(d, kv * head_dim, bias=False)
            self.v_proj = nn.Linear(d, kv * head_dim, bias=False)
            self.o_proj = nn.Linear(h * head_dim, d, bias=False)
            self.q_norm, self.k_norm = RMSNorm(h * head_dim), RMSNorm(kv * head_dim)

        def forward(self, x):
            B, L, _ = x.shape
            q = self.q_norm(self.q_proj(x)).view(B, L, -1, head_dim).transpose(1, 2)
            k = self.k_norm(self.k_proj(x)).view(B, L, -1, head_dim).transpose(1, 2)
            v = self.v_proj(x).view(B, L, -1, head_dim).transpose(1, 2)
            pos = torch.arange(L, device=x.device)
            q, k = rope(q, pos), rope(k, pos)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))

    class SwitchLinear(nn.Module):  # mlx-lm's SwitchLinear: weight (experts, out, in)
        def __init__(self, i, o, e):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(e, o, i).uniform_(-(i**-0.5), i**-0.5))

    class SwitchGLU(nn.Module):
        def __init__(self):
            super().__init__()
            d, i, e = c["hidden_size"], c["intermediate_size"], c["num_experts"]
            self.gate_proj, self.up_proj, self.down_proj = (
                SwitchLinear(d, i, e),
                SwitchLinear(d, i, e),
                SwitchLinear(i, d, e),
            )

    class SparseMoeBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(c["hidden_size"], c["num_experts"], bias=False)
            self.switch_mlp = SwitchGLU()

        def forward(self, x):
            """Returns (output, router logits). All experts run, masked to the top-k: same maths as gathering."""
            B, L, D = x.shape
            xf = x.reshape(-1, D)
            logits = self.gate(xf)
            probs = logits.float().softmax(-1)
            top = probs.topk(c["num_experts_per_tok"], dim=-1).indices
            weights = torch.zeros_like(probs).scatter(1, top, probs.gather(1, top))
            if c["norm_topk_prob"]:
                weights = weights / weights.sum(-1, keepdim=True)
            s = self.switch_mlp
            gate = torch.einsum("nd,eid->nei", xf, s.gate_proj.weight)
            up = torch.einsum("nd,eid->nei", xf, s.up_proj.weight)
            act = F.silu(gate) * up * weights.type_as(xf)[..., None]
            y = torch.einsum("nei,edi->nd", act, s.down_proj.weight)
            return y.view(B, L, D), logits

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attention(), SparseMoeBlock()
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(c["hidden_size"]), RMSNorm(c["hidden_size"])

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            y, logits = self.mlp(self.post_attention_layernorm(x))
            return x + y, logits

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
            self.layers = nn.ModuleList([Block() for _ in range(c["num_hidden_layers"])])
            self.norm = RMSNorm(c["hidden_size"])

    class TinyOlmoe(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
            nn.init.normal_(self.model.embed_tokens.weight, std=0.02)

        def forward(self, ids):
            """Returns (logits, list of per-layer router logits)."""
            h, routers = self.model.embed_tokens(ids), []
            for layer in self.model.layers:
                h, r = layer(h)
                routers.append(r)
            return self.lm_head(self.model.norm(h)), routers

    return TinyOlmoe()


def moe_losses(routers, num_experts: int, k: int):
    """Switch load-balancing loss (E * sum_e f_e P_e, 1.0 when balanced) and router z-loss, averaged over layers."""
    import torch

    balance, z = 0.0, 0.0
    for logits in routers:
        probs = logits.float().softmax(-1)
        top = probs.topk(k, dim=-1).indices
        frac = torch.zeros_like(probs).scatter(1, top, 1.0).mean(0) / k
        balance = balance + num_experts * (frac * probs.mean(0)).sum()
        z = z + torch.logsumexp(logits.float(), -1).pow(2).mean()
    return balance / len(routers), z / len(routers)


def train(
    data: Path,
    out: Path,
    device: str,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    seed: int,
    max_minutes: float,
    shard_mb: float,
    config: dict = CONFIG,
) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    train_ids = torch.from_numpy(np.load(data / "train.npy").astype(np.int64))
    eval_ids = torch.from_numpy(np.load(data / "eval.npy").astype(np.int64))
    model = torch_model(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)

    def lr_at(
        step: int,
    ) -> float:  # warmup, then cosine to zero by the step budget or the time budget, whichever is nearer
        done = max(step / steps, (time.time() - start) / 60 / max_minutes)
        return lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))

    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise M2R2Error("--device cuda: this PyTorch sees no CUDA GPU; use --device mps on a Mac, or cpu (slow)")
    amp = dict(device_type="cuda", dtype=torch.bfloat16) if device.startswith("cuda") else None
    E, k = config["num_experts"], config["num_experts_per_tok"]

    def batch_from(ids, n, g):
        starts = torch.randint(0, ids.numel() - seq - 1, (n,), generator=g)
        x = torch.stack([ids[s : s + seq + 1] for s in starts]).to(device)
        return x[:, :-1], x[:, 1:]

    def losses(x, y):
        with torch.autocast(**amp) if amp else contextlib.nullcontext():
            logits, routers = model(x)
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        balance, z = moe_losses(routers, E, k)
        return ce, balance, z

    log = []
    bar = tqdm(range(steps), desc="training tiny OLMoE", unit="step")
    for step in bar:
        x, y = batch_from(train_ids, batch, gen)
        ce, balance, z = losses(x, y)
        loss = ce + 0.01 * balance + 0.001 * z
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            bar.set_postfix(
                ce=f"{ce.item():.3f}",
                balance=f"{balance.item():.3f}",
                tok_s=f"{(step + 1) * batch * seq / (time.time() - start):,.0f}",
            )
            log.append({"step": step, "ce": ce.item(), "balance": balance.item(), "z": z.item()})
        if (time.time() - start) / 60 > max_minutes:
            bar.write(f"time budget of {max_minutes} min reached at step {step + 1}")
            break
    model.eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        evals = [losses(*batch_from(eval_ids, batch, g))[0].item() for _ in range(8)]
    summary = {
        "steps": step + 1,
        "tokens": (step + 1) * batch * seq,
        "minutes": (time.time() - start) / 60,
        "train_ce": log[-1]["ce"],
        "eval_ce": float(np.mean(evals)),
        "log": log,
    }
    # bf16 shards (exported to float32 later): the folder travels in pieces of at most shard_mb
    state = {n: p.detach().to("cpu", torch.bfloat16).contiguous() for n, p in model.state_dict().items()}
    from safetensors.torch import save_file

    with atomic_folder(out) as tmp:
        shard, size, index = {}, 0, 0
        for name, t in state.items():
            shard[name] = t
            size += t.numel() * 2
            if size > shard_mb * 1e6:
                save_file(shard, str(tmp / f"model-{index:02d}.safetensors"))
                shard, size, index = {}, 0, index + 1
        if shard:
            save_file(shard, str(tmp / f"model-{index:02d}.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        (tmp / "training.json").write_text(json.dumps(summary, indent=1))
    return summary


def mlx_weights(trained: Path) -> dict:
    """The PyTorch shards as float32 MLX arrays, under the same (mlx-lm) names."""
    shards = sorted(trained.glob("model-*.safetensors"))
    if not shards:
        raise M2R2Error(f"{trained} holds no model-*.safetensors; run the train step first")
    weights = {}
    for s in shards:
        weights.update({k: v.astype(mx.float32) for k, v in mx.load(str(s)).items()})
    return weights


def export(trained: Path, data: Path, out: Path, force: bool) -> Path:
    """bf16 PyTorch shards -> one float32 MLX folder that mlx-lm loads (names already match)."""
    refuse_existing(out, force)
    missing = [
        p for p in (trained / "config.json", data / "tokenizer.json", data / "tokenizer_config.json") if not p.is_file()
    ]
    if missing:
        raise M2R2Error(f"{missing[0]} is missing; run the data and train steps first")
    weights = mlx_weights(trained)
    with atomic_folder(out) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text((trained / "config.json").read_text())
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp / name).write_text((data / name).read_text())
        if (trained / "training.json").exists():
            (tmp / "training.json").write_text((trained / "training.json").read_text())
    return out


def _main() -> int:
    ap = argparse.ArgumentParser(prog="python -m m2r2_mlx.moe.tiny_olmoe", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="corpus + BPE tokenizer + token ids")
    d.add_argument("-o", "--output", type=Path, required=True)
    d.add_argument("--vocab", type=int, default=CONFIG["vocab_size"])
    d.add_argument("--force", action="store_true", help="replace an existing output folder")
    t = sub.add_parser("train", help="train in PyTorch (cuda, mps or cpu)")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("-o", "--output", type=Path, required=True)
    t.add_argument("--device", default="cuda")
    t.add_argument(
        "--steps",
        type=int,
        default=1000,
        help="1000 (33M tokens, ~7 epochs) gave the lowest held-out loss of 600/1000/2000",
    )
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-minutes", type=float, default=7.0, help="stop early at this wall time")
    t.add_argument("--shard-mb", type=float, default=15.0)
    t.add_argument("--force", action="store_true", help="replace an existing output folder")
    e = sub.add_parser("export", help="PyTorch shards -> float32 MLX folder")
    e.add_argument("trained", type=Path)
    e.add_argument("--data", type=Path, required=True)
    e.add_argument("-o", "--output", type=Path, required=True)
    e.add_argument("--force", action="store_true")
    a = ap.parse_args()
    if a.cmd == "data":
        refuse_existing(a.output, a.force)
        print(json.dumps(build_data(a.output, a.vocab)))
    elif a.cmd == "train":
        refuse_existing(a.output, a.force)
        if not (a.data / "train.npy").exists():
            raise M2R2Error(f"{a.data} holds no train.npy; run the data step first")
        s = train(a.data, a.output, a.device, a.steps, a.batch, a.seq, a.lr, a.seed, a.max_minutes, a.shard_mb)
        print(json.dumps({k: v for k, v in s.items() if k != "log"}))
    else:
        print(f"wrote {export(a.trained, a.data, a.output, a.force)}")
    return 0


def main() -> None:
    sys.exit(run_cli("tiny_olmoe", _main))


if __name__ == "__main__":
    main()
