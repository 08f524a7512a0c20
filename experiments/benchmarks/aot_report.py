"""The project's own programs compiled for an accelerator from any machine (no device needed):
FLOPs, bytes, memory, custom calls, kernel launches and compile time, against what the model
must do.

    python experiments/benchmarks/aot_report.py --target h100 --model qwen3-0.6b      # CUDA venv
    LD_LIBRARY_PATH=$STUBS python experiments/benchmarks/aot_report.py --target mi300x  # ROCm venv
    python experiments/benchmarks/aot_report.py --target cpu --model toy --rows 4 --context 64 \\
        --sequences 4 --length-scale 0.01                                   # this machine's CPU
    python experiments/benchmarks/aot_report.py --target tpu-v6e --mesh 2x2  # TPU venv, 4 chips

Setup (docs/accelerators.md, "Compiling for an accelerator without one"): JAX's CUDA plugin
(`jax[cuda12]`), ROCm plugin (`jax[rocm7-local]`, with the stand-in ROCm libraries of
`aot/rocm_stubs/build.sh`) or TPU runtime (`jax[tpu]`, libtpu) in a virtual environment of its
own, never the project's. JAX then compiles for a device of a deviceless topology described by
a GPU target-config file (`aot/h100.txtpb`, `aot/mi300x.txtpb`) or a TPU generation and slice
(`tpu-v5e`, `tpu-v6e`: ``--mesh`` FSDPxTP chips, 1x1, 2x2 or 4x4); `cpu` compiles for this
machine's CPU. The programs compile for that device's kernels
(`rstar2_jax.model.target.compiling_for`, compile-only: the kernels' run-time checks are
skipped, the kernels a run there takes when they pass), under the mesh (the TPU kernels split
their work over it). libtpu allows one process at a time on a machine (a lock file).

On a mesh of several chips every figure is one chip's (the programs are SPMD: each chip runs
the same one): the update's params, optimizer state and rows split as the trainer splits them
(`parallel.sharding`); decode's params likewise, each row's keys and values split by kv head
over tp, its rows over fsdp (the pool's pages replicated over fsdp: rows share them).

Programs (``--programs``), each exactly as the run compiles it, on random-shaped abstract inputs
(nothing is allocated):

- ``decode``: the sampler's decode chunk (`sampler.engine.decode_chunk`, ``--chunk`` steps of
  ``--rows`` rows, temperature 1), each row holding ``--context`` tokens in a pool of pages one
  chunk ahead; figures per decode step;
- ``prefill``: the sampler's prefill call (8 rows of up to 512 tokens after ``--context``);
- ``update``: the RL update of one step of stage-1 lengths (``--preset``, ``--sequences``, as
  `bench_packed_update.py` draws them) as `rl.update.RLUpdate` runs it: the step's rollouts laid
  out by the trainer's own packing into micro-batches of ``--micro-batch-rows`` rows
  (``rl.micro_batch_size``) of the rollout budget, a micro-batch's gradient program
  (`add_micro_batch`) run once per micro-batch the step fills, then the optimizer update
  (`apply_update`); AdamW, float32 master weights, bfloat16 compute, ``--remat``: the layers'
  rematerialisation policy (`aot.update`);
- ``old-logprobs``: the update's log-prob pass before it (old log-probs, entropies), once per
  micro-batch;
- ``serving-copy``: the trainer's float32 params cast to the sampler's bfloat16 copy.

Columns:

- ``flops``: the compiled program's matmul FLOPs (`hlo_bytes.costs`: loops multiplied out; XLA's
  own count takes a scanned loop's body once), plus by hand what a custom call computes (cuDNN's
  attention: the model's attention FLOPs; splash attention: the block pairs its causal mask
  visits, `tpu_attention.splash_flops`), against the ``model`` count: 2 x matmul params per
  token forward (6 x for the update: forward and backward) and causal attention over the real
  tokens (decode: over each row's context). Attention on the block-skipping XLA path of packed
  rows runs in loops of data-dependent length: counted from the kernel's plan
  (`packed_attention.packed_block_visits`). The update's figures are its step's: a program's
  FLOPs x its runs a step (the micro-batches the step fills), summed over its programs, against
  the model's count on the step's real tokens, and on every token its micro-batches compute.
- ``bytes``: the bytes the program moves (`hlo_bytes`), cuDNN's paged attention charged with the
  live keys and values it reads, ragged paged attention with the pages it copies in
  (`tpu_attention.ragged_bytes`; the custom call's operand is the whole pool); against the
  ``least``: decode, every param once (on a mesh: its tp share, whole over fsdp) and each row's
  live keys and values once; prefill, the params and the keys and values it reads and writes;
  the update and the old-log-prob pass, none given (compute-bound).
- ``peak`` / ``temp``: XLA's memory analysis (peak of the program's buffers; temporaries),
  against ``base``: params + page pools (sampler), params + AdamW moments + float32 gradients
  (update), params (old-log-prob pass, serving copy), one chip's share; and the device's memory
  (a TPU's HBM; its compiler refuses a program that does not fit). The update's programs run
  with more held beside them (the optimizer state, the step's layout and its other
  micro-batches, placed up front): the peak is the largest program's plus what it holds beside.
- ``launches``: kernels one decode step launches, in all and per layer (`hlo_bytes`; XLA:GPU's
  command buffers may put several into one graph launch).
- ``custom calls``: cuDNN, cuBLAS, Triton / Pallas kernels present (a TPU's Pallas kernels by
  name).
- ``compile``: seconds to lower and compile on this machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a deviceless compile needs no GPU backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from aot.counting import measure, step_figures  # noqa: E402
from aot.programs import (Program, decode_program, prefill_program,  # noqa: E402
                          serving_copy_program)
from aot.report import report  # noqa: E402
from aot.targets import TARGETS, cudnn_asks_the_target, device_memory  # noqa: E402
from aot.update import old_logprobs_program, update_programs  # noqa: E402
from bench_decode import MODELS as DECODE_MODELS  # noqa: E402
from bench_packed_update import PRESETS as LENGTH_PRESETS  # noqa: E402
from rstar2_jax.model import target  # noqa: E402
from rstar2_jax.rl.scale_plan import PRESETS  # noqa: E402

MODELS = DECODE_MODELS | PRESETS
PROGRAMS = ("decode", "prefill", "update", "old-logprobs", "serving-copy")


def _option(value: str):
    """An XLA option's value as its type: a bool, an int, or the string."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return int(value) if value.lstrip("-").isdigit() else value


def build(name: str, config, args, mesh, rows: int | None = None) -> list[Program]:
    """The programs of ``name``: one, or the update's (its gradient program and its optimizer
    update)."""
    if name == "decode":
        return [decode_program(config, args, mesh, rows)]
    if name == "update":
        return update_programs(config, args, mesh)
    return [{"prefill": prefill_program, "old-logprobs": old_logprobs_program,
             "serving-copy": serving_copy_program}[name](config, args, mesh)]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="h100")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b")
    parser.add_argument("--mesh", default="1x1", choices=("1x1", "2x2", "4x4", "1x4", "4x1"),
                        help="FSDPxTP chips (TPU and CPU targets)")
    parser.add_argument("--layers", type=int, help="override the model's depth")
    parser.add_argument("--programs", nargs="+", choices=PROGRAMS, default=list(PROGRAMS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256],
                        help="decode rows (slots)")
    parser.add_argument("--context", type=int, default=2048, help="tokens each row holds")
    parser.add_argument("--chunk", type=int, default=64, help="decode steps per call")
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--preset", choices=sorted(k for k, v in LENGTH_PRESETS.items()
                                                  if v.kind == "rl"), default="stage1-early")
    parser.add_argument("--sequences", type=int, default=16, help="rollouts in the update")
    parser.add_argument("--length-scale", type=float, default=1.0,
                        help="multiplies the preset's lengths and row budget")
    parser.add_argument("--micro-batch-rows", type=int,
                        help="rl.micro_batch_size: rows of the rollout budget a micro-batch "
                             "(default: the trainer's, one per fsdp device)")
    parser.add_argument("--remat", action="store_true", help="rl.remat: rerun each layer whole")
    parser.add_argument("--logprob-chunk", type=int, default=256)
    parser.add_argument("--xla", nargs="*", default=[], metavar="OPTION=VALUE",
                        help="XLA compiler options, e.g. xla_gpu_enable_command_buffer=")
    parser.add_argument("--show", type=int, default=0,
                        help="list this many of each program's largest instructions (bytes)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--hlo", help="write each program's optimized HLO into this folder")
    args = parser.parse_args(argv)
    if args.hlo:
        Path(args.hlo).mkdir(parents=True, exist_ok=True)

    fsdp, tp = (int(n) for n in args.mesh.split("x"))
    if fsdp * tp > 1 and set(args.programs) - {"decode", "update", "old-logprobs"}:
        parser.error("--mesh: only decode, update and old-logprobs are measured on several chips")
    make_devices, runnable = TARGETS[args.target]
    devices = make_devices(fsdp * tp)
    device = devices[0]
    config = MODELS[args.model]
    config = dataclasses.replace(config, dtype="bfloat16", **(
        {"num_layers": args.layers} if args.layers else {}))
    options = {key: _option(value) for key, value in (o.split("=", 1) for o in args.xla)}
    memory = device_memory(args.target)
    mesh = Mesh(np.array(devices).reshape(fsdp, tp), ("fsdp", "tp"))
    print(f"target {args.target}: {device.device_kind}, mesh fsdp {fsdp} x tp {tp}; jax "
          f"{jax.__version__}; model {args.model}, {config.num_layers} layers"
          + (f"; XLA options {options}" if options else ""), flush=True)
    results = []
    # Abstract params are shaped outside the target: a deviceless device cannot run the PRNG.
    for name in args.programs:
        for rows in (args.rows if name == "decode" else [None]):
            with (target.compiling_for(device, compile_only=not runnable, mesh=mesh) as where,
                  cudnn_asks_the_target(where)):
                programs = build(name, config, args, mesh, rows)
                counted = (config if name not in ("update", "old-logprobs")
                           else dataclasses.replace(config, dtype="float32"))
                result = step_figures([measure(
                    program, where, counted, options, args.show,
                    args.hlo and f"{args.hlo}/{args.target}_{name}" + (f"_{rows}" if rows else "")
                    + (f"_{i}" if i else "") + ".hlo") for i, program in enumerate(programs)])
            label = f"{name}" + (f" {rows} rows" if rows else "")
            print(report(label, result, memory), flush=True)
            results.append({"target": args.target, "mesh": args.mesh, "model": args.model,
                            "layers": config.num_layers,
                            "program": name, "rows": rows, "options": options} | result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
