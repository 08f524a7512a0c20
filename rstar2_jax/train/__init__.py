"""Training: configs, optimizer, the sharded train step, checkpoints, metrics and SFT (the RL
step and its loop are `rstar2_jax.rl`).

    configs.py     frozen dataclass job configs (paper defaults), loaded by rstar2_jax.config
    optim.py       AdamW + warmup/constant/cosine schedule + global-norm clipping
    step.py        jitted, mesh-sharded train step; exact token-mean micro-batch accumulation
    checkpoint.py  orbax checkpoints: exact resume, corruption fallback, Hugging Face export
    metrics.py     JSONL + TensorBoard + progress bar; phase timers
    run.py         set-up / resume / init_from / log / save shared by every loop
    sft.py         supervised fine-tuning on chat-formatted JSONL
"""
