"""Where the held-out errors of toy runs are: each evaluation's samples by outcome (answered in
its head, no working call, miscopied numbers, misread output, ...; `toy.failures.sample_outcome`)
and the share right per problem kind, as a Markdown table.

    python experiments/toy/heldout_errors.py runs/demo                       # eval_sft and eval_rl
    python experiments/toy/heldout_errors.py runs/d0 runs/d1 runs/testbed/seed0

Each directory is a main job's ``out`` (or a testbed seed's): its ``data/test.jsonl`` gives the
problems' kinds, and every ``eval_*.jsonl`` in it is one row.
"""
import argparse
import json
from pathlib import Path

from rstar2_jax.data.datasets import jsonl_rows
from rstar2_jax.toy.failures import OUTCOMES, outcome_shares


def table(run_dirs: list[Path]) -> str:
    """The Markdown table of every ``eval_*.jsonl`` of ``run_dirs`` (percent of samples)."""
    rows = []
    for run in run_dirs:
        kinds = [problem["kind"] for _, problem in jsonl_rows(run / "data" / "test.jsonl", "toy problems")]
        for path in sorted(run.glob("eval_*.jsonl"), key=lambda p: (p.stem != "eval_sft", p.stem)):
            records = [r for _, r in jsonl_rows(path, "held-out samples")]
            rows.append((f"{run} {path.stem[5:]}", outcome_shares(records, kinds)))
    if not rows:
        raise SystemExit(f"no eval_*.jsonl in {', '.join(map(str, run_dirs))}")
    kind_names = sorted({k for _, shares in rows for k in shares} - {"all"})
    head = ["run, policy", *OUTCOMES, *(f"right: {k}" for k in kind_names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, shares in rows:
        cells = [f"{100 * shares['all'][o]:.1f}" for o in OUTCOMES]
        cells += [f"{100 * shares[k]['right']:.0f}" if k in shares else "" for k in kind_names]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    print(table(parser.parse_args().run_dirs))
