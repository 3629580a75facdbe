"""Decoding strategies over a base model and its M2R2 adapters: plain (generate), lossless speculative
(speculative, drafters, sampling), dynamic early exit (early_exit), chosen by name (methods), in
multi-turn sessions (chat), with shared statistics (stats)."""
