"""The docs that restate the code are checked against it: the algorithm table of
docs/algorithms.md lists exactly the registry's algorithms, and docs/config.md is the current
output of its generator."""
import re
from pathlib import Path

from rstar2_jax import config_reference
from rstar2_jax.algorithms import ALGORITHMS

DOCS = Path(__file__).parent.parent / "docs"


def test_the_algorithm_table_lists_the_registry():
    text = (DOCS / "algorithms.md").read_text()
    table = text[text.index("| `rl.algorithm` |"):].split("\n\n")[0]
    names = re.findall(r"^\| `(\w+)`", table, re.M)  # the header cell, `rl.algorithm`, is no match
    assert sorted(names) == sorted(ALGORITHMS) and len(names) == len(set(names))


def test_the_config_reference_is_current():
    assert (DOCS / "config.md").read_text() == config_reference.render(), (
        "docs/config.md is stale: python -m rstar2_jax.config_reference > docs/config.md")
