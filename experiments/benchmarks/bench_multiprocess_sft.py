"""SFT step time: 2 JAX processes x 2 CPU devices next to 1 process x 4 CPU devices.

    python experiments/benchmarks/bench_multiprocess_sft.py [--steps 10] [--seq-len 512]

Both runs train the same small random Qwen3 (hidden 128, 2 layers, toy tokenizer) on the same
tool-using conversations with the same mesh shape (fsdp=2 over the processes, tp=2 within
each), through the CLI: ``python -m rstar2_jax sft`` and ``python -m rstar2_jax launch
--processes 2 sft``. Per step it reports the medians (the first step, which compiles, left
out) of process 0's phases from metrics.jsonl: ``data`` (encoding its rows, padding, placing
them with make_array_from_process_local_data) and ``update`` (the jitted train step, whose
collectives cross processes in the 2-process run), and the whole run's wall-clock time
(start-up, compilation and checkpoints included).
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


def run(d: Path, name: str, processes: int, steps: int, seq_len: int) -> dict:
    batch = 8
    args = ["sft", f"model.path={d}/model", f"data={d}/sft.jsonl", f"run_dir={d}/{name}",
            f"seq_len={seq_len}", f"batch_size={batch}", "epochs=1", "mesh.fsdp=2", "mesh.tp=2",
            f"checkpoint.every={steps}"]
    launch = ["launch", "--processes", str(processes)] if processes > 1 else []
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={4 // processes}")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rstar2_jax", *launch, *args], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (d / name / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == steps, f"{name}: {len(records)} records for {steps} steps"
    later = records[1:]
    return {"data_s": statistics.median(r["time/data"] for r in later),
            "update_s": statistics.median(r["time/update"] for r in later),
            "wall_s": wall, "loss": records[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_inputs(d, conversations=8 * args.steps)
        one = run(d, "one", 1, args.steps, args.seq_len)
        two = run(d, "two", 2, args.steps, args.seq_len)
    print(f"{'':26}{'data s/step':>12}{'update s/step':>15}{'run wall s':>12}{'final loss':>12}")
    for name, r in (("1 process x 4 devices", one), ("2 processes x 2 devices", two)):
        print(f"{name:26}{r['data_s']:12.4f}{r['update_s']:15.4f}{r['wall_s']:12.1f}{r['loss']:12.6f}")
    print(f"update 2-process / 1-process: {two['update_s'] / one['update_s']:.2f}")


if __name__ == "__main__":
    main()
