"""The M2R2 model: a fast residual stream with accelerator adapters beside a frozen base (fast_stream),
its configuration and files (config, adapters, draft_vocab), the LoRA adapter form and ARLA exit decisions."""
