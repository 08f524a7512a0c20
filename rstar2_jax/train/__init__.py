"""Training: configs, optimizer, the sharded train step, checkpoints, metrics and the loops.

    configs.py     frozen dataclass job configs (paper defaults), loaded by rstar2_jax.config
    optim.py       AdamW + warmup/constant/cosine schedule + global-norm clipping
    step.py        jitted, mesh-sharded train step; exact token-mean micro-batch accumulation
    checkpoint.py  orbax checkpoints: exact resume, corruption fallback, Hugging Face export
    metrics.py     JSONL + TensorBoard + progress bar; phase timers
    run.py         set-up / resume / init_from / log / save shared by every loop
    sft.py         supervised fine-tuning on chat-formatted JSONL
    rl_update.py   the RL optimizer update on a prepared batch of kept rollouts
    rl_data.py     scored rollouts -> training batch (equal-reward filter, RoC, advantages)
    rl.py          the RL loop (rollouts -> rewards -> batch -> update)
    scale_plan.py  per-device memory of the RL step at scale, compiled without weights
"""
