"""Step time of a job as 2 JAX processes x 2 CPU devices next to 1 process x 4 CPU devices.

    python experiments/benchmarks/bench_multiprocess.py sft [--steps 10] [--seq-len 512]
    python experiments/benchmarks/bench_multiprocess.py rl [--steps 6]

Both runs of a job use the same mesh shape (fsdp=2 over the processes, tp=2 within each) and
run through the CLI: ``python -m rstar2_jax <job>`` and ``python -m rstar2_jax launch
--processes 2 <job>``. Per step it reports the medians (the first step, which compiles, left
out) of the phases in metrics.jsonl, and the whole run's wall-clock time (start-up,
compilation and checkpoints included).

sft: a small random Qwen3 (hidden 128, 2 layers, toy tokenizer) on tool-using conversations;
phases ``data`` (encoding this process's rows, placing them with
make_array_from_process_local_data) and ``update`` (the train step, whose collectives cross
processes in the 2-process run), process 0's clock.

rl: the tests' tiny RL task (``tests/rl_setup.py``: a tiny Qwen3 fine-tuned to half guess
answers 1 or 2), 8 questions x 8 rollouts per step with the real sandbox and verifier, GRPO-RoC;
phases ``rollout`` (sampling and tool calls; the slowest host's), ``reward wait`` (scoring
still running after the last rollout; the slowest host's) and ``update`` (process 0's clock).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_inputs(d: Path, conversations: int) -> None:
    import jax

    from rstar2_jax import chat
    from rstar2_jax.model import ModelConfig, init_params, save_hf
    from rstar2_jax.toy.tokenizer import build_tokenizer

    fmt = chat.get_format("rstar2")
    rows = []
    for i in range(conversations):
        rows.append([{"role": "user", "content": f"What is {i} times {i + 3}?"},
                     {"role": "assistant", "content": chat.format_tool_call(f"print({i} * {i + 3})")},
                     {"role": "tool", "content": str(i * (i + 3))},
                     {"role": "assistant", "content": f"</reason><answer>\\boxed{{{i * (i + 3)}}}</answer>"}])
    (d / "sft.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    corpus = [fmt.prompt_text(r[0]["content"]) for r in rows] + [m["content"] for r in rows for m in r[1:]]
    tokenizer = build_tokenizer(corpus, vocab_size=1024)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=128,
                         intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=32, qk_norm=True)
    save_hf(d / "model", config, init_params(config, jax.random.key(0)))
    tokenizer.save_pretrained(d / "model")


def sft_args(d: Path, name: str, steps: int, seq_len: int) -> list[str]:
    return ["sft", f"model.path={d}/model", f"data={d}/sft.jsonl", f"run_dir={d}/{name}",
            f"seq_len={seq_len}", "batch_size=8", "epochs=1", "mesh.fsdp=2", "mesh.tp=2",
            f"checkpoint.every={steps}"]


def rl_args(d: Path, name: str, steps: int, seq_len: int) -> list[str]:
    del seq_len  # the rollout budget sets it
    from rl_setup import rl_overrides

    return ["rl", *rl_overrides(d, name, steps, "stage.name=bench", "rl.questions_per_step=8",
                                "mesh.fsdp=2", "mesh.tp=2", "rollout.num_slots=32",
                                f"checkpoint.every={steps}")]


PHASES = {"sft": {"data s": "time/data", "update s": "time/update"},
          "rl": {"rollout s": "time/rollout_s", "reward wait s": "time/reward_wait_s",
                 "update s": "time/update_s"}}


def run(d: Path, job: str, name: str, processes: int, steps: int, seq_len: int) -> dict:
    args = (sft_args if job == "sft" else rl_args)(d, name, steps, seq_len)
    launch = ["launch", "--processes", str(processes)] if processes > 1 else []
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={4 // processes}")
    start = time.perf_counter()
    # -c: the CLI with the toy chat format registered, which the RL task's model uses.
    cli = "import sys, rstar2_jax.toy; from rstar2_jax.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", cli, *launch, *args], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (d / name / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == steps, f"{name}: {len(records)} records for {steps} steps"
    later = records[1:]
    phases = {label: statistics.median(r[key] for r in later) for label, key in PHASES[job].items()}
    return phases | {"run wall s": wall, "final loss": records[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", choices=sorted(PHASES))
    parser.add_argument("--steps", type=int, default=None, help="default: sft 10, rl 6")
    parser.add_argument("--seq-len", type=int, default=512, help="sft rows' length")
    args = parser.parse_args()
    steps = args.steps or {"sft": 10, "rl": 6}[args.job]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        if args.job == "sft":
            write_inputs(d, conversations=8 * steps)
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
            from rl_setup import write_rl_setup

            write_rl_setup(d)
        one = run(d, args.job, "one", 1, steps, args.seq_len)
        two = run(d, args.job, "two", 2, steps, args.seq_len)
    columns = list(one)
    print(f"{args.job}, medians per step over steps 2-{steps}")
    print(f"{'':26}" + "".join(f"{c:>15}" for c in columns))
    for name, r in (("1 process x 4 devices", one), ("2 processes x 2 devices", two)):
        print(f"{name:26}" + "".join(f"{r[c]:15.4f}" for c in columns))


if __name__ == "__main__":
    main()
