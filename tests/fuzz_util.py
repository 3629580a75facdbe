"""What the fuzz tests share: a watchdog against hangs, the check that a refusal is one line, and small real files
to damage (a tiny llama GGUF in llama.cpp's layout, tiny M2R2 adapters)."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import struct
import sys
from pathlib import Path

from m2r2_mlx.errors import M2R2Error

import gguf
import numpy as np

HANG_S = 60  # a case still running after this long is a hang: the watchdog ends the process with its stack


@contextlib.contextmanager
def watchdog(seconds: float = HANG_S):
    """A hang inside native code (where no Python timeout reaches) ends the test process with every thread's
    stack on stderr, instead of stalling the suite."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def one_line(error: BaseException) -> str:
    """An M2R2Error's message, checked to be the one clear line a user sees."""
    assert isinstance(error, M2R2Error), f"{type(error).__name__}: {error}"
    message = str(error)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


# GPT-2's byte-level alphabet: every byte as a printable character (how byte-level BPE vocabularies write bytes)
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_CHARS = {b: chr(b) for b in _PRINTABLE}
BYTE_CHARS.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in BYTE_CHARS)})
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def tiny_gguf(path: Path, quantized: bool = False, layers: int = 2, hidden: int = 64) -> Path:
    """A small llama GGUF as llama.cpp writes one: byte-level BPE vocabulary with a few merges and ChatML's
    special tokens, q/k rows permuted; float32 tensors, or Q8_0 matrices with ``quantized``."""
    rng = np.random.default_rng(0)
    tokens = [BYTE_CHARS[b] for b in range(256)] + ["Ġt", "he", "Ġthe"] + SPECIALS
    merges = ["Ġ t", "h e", "Ġt he"]
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 3: control tokens
    vocab, ff, heads = len(tokens), 96, 4
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template(TEMPLATE)

    def add(name: str, *shape: int):
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if quantized and len(shape) == 2 and shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            w.add_tensor(name, data)

    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden)
    kv = hidden // heads * 2
    for i in range(layers):
        shapes = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (hidden, hidden), "attn_k": (kv, hidden),
                  "attn_v": (kv, hidden), "attn_output": (hidden, hidden), "ffn_gate": (ff, hidden),
                  "ffn_up": (ff, hidden), "ffn_down": (hidden, ff)}  # fmt: skip
        for name, shape in shapes.items():
            add(f"blk.{i}.{name}.weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def safetensors_header(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (its JSON) and the bytes after it."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_safetensors(path: Path, header: dict, body: bytes, length: int | None = None) -> None:
    """A safetensors file from a header (written as given, however wrong) and a body; ``length``: the header
    length field, if it should lie."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)
