"""The RL stage, in reading order (docs/design.md, "Reading one RL step"):

    step.py      one RL step top to bottom: rollout -> score -> select and advantages ->
                 batch -> update (`RLStep`: the sampler's side and the trainer's)
    data.py      host-side glue of a step: trajectories -> `Rollouts` arrays, the algorithm's
                 selection checked, the training batch and its id check, the step's metrics
    update.py    the optimizer update on a batch: proximal (old) log-probs, rollout correction,
                 the algorithm's loss, optax; packed or padded rows
    exchange.py  what the hosts of a multi-process run tell each other (identity on one)
    loop.py      `run_rl`: the stage's set-up and the two drivers of its steps, synchronous
                 and asynchronous (``rl.max_staleness``)
    scale_plan.py  per-device memory of the RL step at scale, compiled without weights
"""
