"""The toy task: a CPU-sized end-to-end run of the library, outside its core.

    format.py     the toy's chat format (registered as ``model.chat_format=toy`` on import)
    problems.py   integer problems a tiny model can solve only with the Python tool
    tokenizer.py  a small Qwen-style BPE tokenizer trained on the toy corpus
    sft_data.py   deliberately imperfect SFT demonstrations, run in the real sandbox
    build.py      the toy data directory: problem splits, demonstrations, tokenizer
    demo.py       the main job (``python -m rstar2_jax demo``): data, SFT, GRPO-RoC, evaluation
    compare.py    RL variants side by side from one SFT policy (notebook 03)
    testbed.py    arms x seeds from one SFT policy per seed, summarised (experiments/toy/testbed.py)

The library core never imports this package; the CLI's ``demo`` command loads it lazily.
"""
from rstar2_jax.toy.format import TOY_FORMAT

__all__ = ["TOY_FORMAT"]
