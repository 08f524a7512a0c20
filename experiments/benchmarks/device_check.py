"""One call on a lent GPU: decode, the packed update, a shortened whole RL step and the AOT
tool's figures for the same programs, in one JSON (run by device_check.sh; see there).

Each part runs in a process of its own, under a time limit; a part that fails or runs out of
time is recorded with its error and the others still run. ``--cpu-smoke`` runs every part at
tiny shapes on this machine's CPU (minutes), to check the script before a lease.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


# A lease's call: everything within 8 minutes, the JSON written before.
DEADLINE_S = 460


PARTS = ("decode", "decode_long_prompts", "update", "rl_step", "decode_unrolled", "aot")


def _run(name: str, argv: list[str], limit: float, out: dict, env: dict | None = None):
    """Runs `argv` for at most `limit` seconds and what is left before the deadline (not on a
    smoke run); keeps its last output lines in out["logs"][name]; True when it succeeded."""
    start = time.perf_counter()
    if {"rl_setup": "rl_step"}.get(name, name) not in out["parts"]:
        return False
    if not out["cpu_smoke"]:
        limit = min(limit, DEADLINE_S - (start - out["started"]))
        if limit < 10:
            out["errors"][name] = "not run: the 8 minutes were spent"
            return False
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=limit, cwd=ROOT,
                              env=os.environ | (env or {}))
    except subprocess.TimeoutExpired as e:
        out["errors"][name] = f"over its limit of {limit:.0f} s"
        out["logs"][name] = (e.stdout or b"").decode(errors="replace")[-4000:] if isinstance(
            e.stdout, bytes) else (e.stdout or "")[-4000:]
        return False
    out["seconds"][name] = round(time.perf_counter() - start, 1)
    out["logs"][name] = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode:
        out["errors"][name] = f"exit {proc.returncode}: {proc.stderr[-1500:]}"
        return False
    return True


def _json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def write_rl_setup(directory: Path, smoke: bool) -> None:
    """Random weights of the Qwen3-0.6B shape (a 2-layer, hidden-64 Qwen3 of the same vocabulary
    for the smoke run) with a tokenizer of Qwen3's layout, and a few arithmetic problems."""
    import dataclasses

    import jax

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers_qwen_tokenizer import qwen3_style_tokenizer

    from rstar2_jax import chat
    from rstar2_jax.data.datasets import Problem, save_problems
    from rstar2_jax.model import init_params, save_hf
    from rstar2_jax.rl.scale_plan import PRESETS

    problems = [Problem(f"What is {a} times {b}, plus {a}?", str(a * b + a))
                for a, b in ((3, 7), (12, 5), (9, 9), (21, 4), (6, 13), (8, 17), (15, 15), (4, 25))]
    save_problems(directory / "problems.jsonl", problems)
    corpus = [chat.ChatFormat().prompt_text(p.question) for p in problems] * 3
    qwen3_style_tokenizer(directory / "model", corpus, merges=800)
    config = PRESETS["qwen3-0.6b"]
    if smoke:
        config = dataclasses.replace(config, hidden_size=64, intermediate_size=128, num_layers=2,
                                     num_heads=4, num_kv_heads=2, head_dim=16)
    save_hf(directory / "model", dataclasses.replace(config, dtype="float32"),
            init_params(dataclasses.replace(config, dtype="float32"), jax.random.key(0)))


def rl_step_overrides(directory: Path, smoke: bool, rollout_devices: int) -> list[str]:
    """experiments/paper/stage1.yaml, shortened: one step of 8 questions x 8 rollouts (4 kept),
    responses up to 1,024 tokens (64 for the smoke run), no checkpoint before the end."""
    return [f"model.path={directory}/model", f"run_dir={directory}/rl", "stage.steps=1",
            f"stage.dataset={directory}/problems.jsonl", "stage.max_turns=2",
            f"stage.max_response_tokens={64 if smoke else 1024}", "rl.questions_per_step=8",
            "rl.rollouts_per_question=8", "rl.group_size=4",
            "rl.micro_batch_size=null", "checkpoint.every=1000", "rollout.sandbox_workers=2",
            f"rollout.num_slots={8 if smoke else 64}", f"mesh.rollout_devices={rollout_devices}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON to write")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on this CPU")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="run only these parts")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    py = sys.executable
    bench = HERE
    out = {"cpu_smoke": smoke, "parts": args.parts, "errors": {}, "seconds": {}, "logs": {},
           "started": time.perf_counter()}
    # On a lease the whole call has 8 minutes: each part its share, in order of importance.
    limits = ({"decode": 900, "decode_long_prompts": 600, "update": 900, "rl_step": 1200,
               "decode_unrolled": 900, "aot": 900} if smoke else
              {"decode": 100, "decode_long_prompts": 45, "update": 100, "rl_step": 120,
               "decode_unrolled": 60, "aot": 70})
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        import jax

        out["device"] = f"{jax.devices()[0].device_kind} x{jax.device_count()} ({jax.default_backend()})"
        out["jax"] = jax.__version__
        devices = jax.device_count()
        # Decode: 1 / 64 / 256 rows, and 64 rows of 2,048-token prompts.
        model = ["--model", "qwen3-tiny", "--dtype", "float32"] if smoke else [
            "--model", "qwen3-0.6b", "--dtype", "bfloat16"]
        if _run("decode", [py, str(bench / "bench_decode.py"), *model, "--batches",
                           *(["1", "4"] if smoke else ["1", "64", "256"]), "--prompt-tokens",
                           "16" if smoke else "128", "--new-tokens", "16" if smoke else "256",
                           "--repeats", "2", "--json", str(tmp / "decode.json")],
                limits["decode"], out):
            out["decode"] = _json(tmp / "decode.json")
        if _run("decode_long_prompts", [py, str(bench / "bench_decode.py"), *model, "--batches",
                                         "4" if smoke else "64", "--prompt-tokens",
                                         "64" if smoke else "2048", "--new-tokens",
                                         "8" if smoke else "128", "--repeats", "1", "--json",
                                         str(tmp / "long.json")],
                limits["decode_long_prompts"], out):
            out["decode_long_prompts"] = _json(tmp / "long.json")
        # The packed update at stage-1 lengths: bfloat16 compute, float32 master weights.
        update = (["--model", "toy", "--length-scale", "0.02", "--sequences", "4"] if smoke
                  else ["--model", "qwen3-0.6b", "--sequences", "16"])
        if _run("update", [py, str(bench / "bench_packed_update.py"), "--preset", "stage1-early",
                           *update, "--micro-batches", "2", "--params", "float32", "--compute",
                           "bfloat16", "--repeats", "2", "--json", str(tmp / "update.json")],
                limits["update"], out):
            out["update"] = _json(tmp / "update.json")
        # A shortened whole RL step of stage 1, rollout devices split from the training ones
        # where there are two devices or more.
        rollout_devices = 1 if devices >= 2 else 0
        out["rl_step_rollout_devices"] = rollout_devices
        setup = tmp / "rl"
        setup.mkdir()
        if _run("rl_setup", [py, __file__, "--write-setup", str(setup)] + ["--cpu-smoke"] * smoke,
                limits["rl_step"] / 2, out):
            if _run("rl_step", [py, "-m", "rstar2_jax", "rl", "--config",
                                "experiments/paper/stage1.yaml",
                                *rl_step_overrides(setup, smoke, rollout_devices)],
                    limits["rl_step"], out):
                metrics = setup / "rl" / "metrics.jsonl"
                out["rl_step"] = [json.loads(line) for line in metrics.read_text().splitlines()]
        # The layers unrolled: XLA:GPU then captures each layer's kernels in a command buffer
        # (~30 graph launches a step instead of ~860 kernels; docs/accelerators.md).
        if _run("decode_unrolled", [py, str(bench / "bench_decode.py"), *model, "--batches",
                                    *(["1", "4"] if smoke else ["1", "64"]), "--prompt-tokens",
                                    "16" if smoke else "128", "--new-tokens",
                                    "16" if smoke else "256", "--repeats", "2", "--unroll-layers",
                                    "--json", str(tmp / "unrolled.json")],
                limits["decode_unrolled"], out):
            out["decode_unrolled"] = _json(tmp / "unrolled.json")
        # The AOT tool's figures for the same programs, compiled deviceless for the H100 (or,
        # smoke, this CPU), beside the measured times.
        aot = (["--target", "cpu", "--model", "toy", "--rows", "1", "4", "--context", "24",
                "--chunk", "8", "--sequences", "4", "--length-scale", "0.02"] if smoke else
               ["--target", "h100", "--model", "qwen3-0.6b", "--rows", "1", "64", "256",
                "--context", "256", "--sequences", "16"])
        if _run("aot", [py, str(bench / "aot_report.py"), *aot, "--programs", "decode", "update",
                        "--micro-batch-rows", "1", "--json", str(tmp / "aot.json")],
                limits["aot"], out, env={"JAX_PLATFORMS": "cpu"}):
            out["aot"] = _json(tmp / "aot.json")
    out["total_s"] = round(time.perf_counter() - out.pop("started"), 1)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{args.out}: {len(out['errors'])} part(s) failed {sorted(out['errors'])}; "
          f"{out['total_s']:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--write-setup":
        write_rl_setup(Path(sys.argv[2]), "--cpu-smoke" in sys.argv)
    else:
        main()
