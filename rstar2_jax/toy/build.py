"""Builds the toy data directory: problem splits, SFT demonstrations and the tokenizer.

Layout of the directory::

    train.jsonl    training problems (question, answer, kind, code, estimate, notebook form)
    test.jsonl     held-out problems, disjoint from train
    sft.jsonl      demonstrations for the first ``n_sft`` training problems
    tokenizer/     the toy tokenizer in Hugging Face format, trained on the demonstrations
"""
from __future__ import annotations

import dataclasses
import os

from rstar2_jax.data.datasets import save_problems
from rstar2_jax.sandbox import Executor
from rstar2_jax.toy import problems, sft_data
from rstar2_jax.toy.format import TOY_FORMAT
from rstar2_jax.toy.tokenizer import build_tokenizer


@dataclasses.dataclass(frozen=True)
class ToyDataConfig:
    """Sizes and seeds of the toy data.

    Attributes:
      n_train, n_test: problems in each split.
      n_sft: demonstrations, made from the first ``n_sft`` training problems.
      vocab_size: upper bound on the tokenizer's vocabulary.
      seed: seeds the problems and the choice of demonstration styles.
      kinds: the problem kinds, drawn uniformly (``problems.KINDS``; default the main job's five).
      mix: fractions of demonstration styles.
      tool_response_chars, show_tool_time: how tool results are rendered in the demonstrations;
        the RL rollout must use the same values (``RolloutSettings``) so the model sees one format.
      tool_session: the demonstrations' calls share one tool session (the testbed's session
        environment, docs/testbed.md; ``RolloutSettings.tool_session`` must match): a first
        call computes ``ans`` from the question's numbers bound to names, the next prints it,
        and a slip in the first call costs no second copy of the numbers (``sft_data``).
    """

    n_train: int = 4000
    n_test: int = 200
    n_sft: int = 1000
    vocab_size: int = 1024
    seed: int = 0
    kinds: list[str] = dataclasses.field(default_factory=lambda: list(problems.DEFAULT_KINDS))
    mix: sft_data.DemoMix = sft_data.DemoMix()
    tool_response_chars: int = 1024
    show_tool_time: bool = False
    tool_session: bool = False

    def __post_init__(self):
        if not 0 < self.n_sft <= self.n_train:
            raise ValueError(f"n_sft must be in 1..n_train={self.n_train}; got {self.n_sft}")
        problems.check_kinds(self.kinds)


def build_toy_data(directory: str | os.PathLike, config: ToyDataConfig, executor: Executor) -> None:
    """Writes the toy data directory (see the module docstring); ``executor`` runs the demo programs."""
    os.makedirs(directory, exist_ok=True)
    train, test = problems.make_splits(config.n_train, config.n_test, seed=config.seed,
                                        kinds=config.kinds)
    demos = sft_data.make_demos(
        train[: config.n_sft], executor, config.mix, seed=config.seed,
        max_chars=config.tool_response_chars, show_time=config.show_tool_time,
        session=config.tool_session,
    )
    save_problems(os.path.join(directory, "train.jsonl"), train)
    save_problems(os.path.join(directory, "test.jsonl"), test)
    sft_data.save_demos(os.path.join(directory, "sft.jsonl"), demos)
    tokenizer = build_tokenizer(sft_data.corpus(demos, TOY_FORMAT), config.vocab_size)
    tokenizer.save_pretrained(os.path.join(directory, "tokenizer"))
