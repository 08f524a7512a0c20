"""Reading a compiled program (`aot_report.py`'s columns): FLOPs with loops multiplied out and
what custom calls compute counted by hand, bytes moved, memory, custom calls and launches; and a
step's figures from those of its programs."""
from __future__ import annotations

import re
import time
from pathlib import Path

import jax

import hlo_bytes
from aot.programs import Program
from rstar2_jax.model import ModelConfig, packed_attention, target, tpu_attention


def _pallas_tpu_name(name: str) -> str:
    """A TPU Pallas kernel's name from its custom call's instruction name (`name.N`)."""
    return re.sub(r"\.\d+$", "", name)


def _custom_calls(text: str) -> dict[str, int]:
    """Custom calls (cuDNN, cuBLAS, Pallas on TPU by kernel name) and Triton fusions, by name:
    how many."""
    found = {}
    tpu = [_pallas_tpu_name(n) for n in re.findall(
        r'^\s*(?:ROOT )?%(\S+) = .*custom_call_target="tpu_custom_call"', text, flags=re.M)]
    for name in tpu + [t for t in re.findall(r'custom_call_target="([^"]*)"', text)
                       if t != "tpu_custom_call"] + re.findall(r'"kind":"(__triton[\w]*)"', text):
        found[name] = found.get(name, 0) + 1
    return found


def _attention_call(cost) -> bool:
    """A custom call that is attention: cuDNN's, or a Pallas kernel (Triton on GPUs)."""
    return cost.target.startswith("__cudnn$fmha") or cost.target == "__gpu$xla.gpu.triton"


def _attention_by_hand(costs, program: Program, config: ModelConfig, where: target.Target,
                       dependent) -> tuple[float, str]:
    """FLOPs of the attention the matmul count cannot see, and how they were counted: cuDNN's
    calls (the model's attention per forward call, twice that per backward call), the
    block-skipping kernel's loops (its plan), or a decode step's page loop (the model's)."""
    splash = [c for c in costs if c.target == "tpu_custom_call" and c.name.startswith("splash_mha_")]
    if splash:
        rows, t = program.args[-1]["inputs"].shape  # a micro-batch's
        # A call covers one micro-batch's rows (a chip: its share of them, its heads).
        share = program.repeats * (program.fsdp if rows % program.fsdp == 0 else 1)
        heads = config.num_heads // (program.tp if config.num_kv_heads % program.tp == 0 else 1)
        kinds = {kind: sum(c.times for c in splash if c.name.startswith(f"splash_mha_{kind}"))
                 for kind in ("fwd", "dq", "dkv")}
        return (sum(n * tpu_attention.splash_flops(program.segments, t, heads, config.head_dim,
                                                   kind) / share for kind, n in kinds.items()),
                "splash attention by the block pairs it computes: " + ", ".join(
                    f"{n} {kind} calls" for kind, n in kinds.items()))
    ragged = [c for c in costs if c.target == "tpu_custom_call"
              and c.name.startswith("ragged_paged_attention")]
    if ragged:
        return (sum(c.times for c in ragged) * program.ragged_flops_per_layer,
                "ragged paged attention by hand: the keys of the pages it reads")
    calls = [c for c in costs if _attention_call(c)]
    if calls:
        forward = sum(c.times for c in calls if "Backward" not in c.target)
        backward = sum(c.times for c in calls if "Backward" in c.target)
        per_call = program.attention_fwd / (config.num_layers * program.repeats)
        return ((forward + 2 * backward) * per_call,
                f"attention kernels by hand: {forward / program.per:.0f} forward, "
                f"{backward / program.per:.0f} backward calls")
    if not any(c.flops and dependent(c) for c in costs):
        return 0.0, ""
    if program.segments is not None:
        block = packed_attention._BLOCK
        group = packed_attention._GROUP if where.accelerator else 1
        t = program.args[-1]["inputs"].shape[1]
        with jax.default_device(jax.devices("cpu")[0]):  # the plan is counted on the host
            forward, backward = packed_attention.packed_block_visits(program.segments, t, block,
                                                                     group)
        per_matmul = 2 * block**2 * config.head_dim * config.num_heads * config.num_layers
        # The plan is the step's (all its micro-batches' rows): one run's share of it.
        return ((forward * 2 * program.forwards + backward * 5 * program.backwards) * per_matmul
                / program.repeats,
                f"block-skipping attention by its plan: {forward:,} forward, {backward:,} "
                f"backward block pairs, forward x{program.forwards}")
    return program.attention_fwd * program.per, "attention of the page loop by the model's count"


def measure(program: Program, where: target.Target, config: ModelConfig, options: dict,
            show: int = 0, hlo: str | None = None) -> dict:
    """Compiles `program` for the current target and reads the figures (see the module doc)."""
    start = time.perf_counter()
    try:
        compiled = program.fn.lower(*program.args, **program.kwargs).compile(
            compiler_options=options or None)
    except jax.errors.JaxRuntimeError as e:  # a TPU's compiler refuses what exceeds its HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {"compile_s": round(time.perf_counter() - start, 1), "note": program.note,
                "does_not_fit": str(e).split("\n")[0][:400], "base_bytes": program.base_bytes}
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    if hlo:
        Path(hlo).write_text(text)
    memory = compiled.memory_analysis()
    costs = hlo_bytes.costs(text, unknown_trips=program.per)
    own = 1 if program.per > 1 else 0  # the decode chunk's loop: `per` steps

    def dependent(c):  # in a loop of data-dependent length other than the chunk's own
        return sum(trips is None for _, trips in c.loops) > own

    hand, how = _attention_by_hand(costs, program, config, where, dependent)
    flops = sum(c.flops * c.times for c in costs if not dependent(c)) + hand
    def charged(c):  # bytes per run of the program
        # A paged decode kernel's operands are the whole pools; it reads the live keys and
        # values (and writes its output): cuDNN's or Triton's, or ragged paged attention on a
        # TPU, by the page blocks it copies in.
        if program.kv_per_layer and _attention_call(c):
            return (program.kv_per_layer + c.out) * c.times
        if c.target == "tpu_custom_call" and c.name.startswith("ragged_paged_attention"):
            return (program.ragged_per_layer + c.out) * c.times
        return c.bytes * c.times

    moved = sum(map(charged, costs))
    layer = [c for c in costs if any(trips == config.num_layers for _, trips in c.loops)]
    largest = sorted(costs, key=lambda c: -charged(c))[:show]
    runs = program.repeats / program.per  # per unit of the figures
    return {
        "compile_s": round(seconds, 1), "note": program.note, "name": program.name,
        "flops_note": how, "runs": program.repeats, "flops_per_run": flops,
        "flops": flops * runs, "model_flops": program.model_flops,
        "computed_flops": program.computed_flops,
        "bytes": moved * runs, "least_bytes": program.least_bytes,
        "bytes_note": "data-dependent loops counted once" if any(map(dependent, costs)) else "",
        # What the run holds while the program runs: its buffers and what is held beside them.
        "peak_bytes": memory.peak_memory_in_bytes + program.beside,
        "program_peak_bytes": memory.peak_memory_in_bytes, "beside_bytes": program.beside,
        "temp_bytes": memory.temp_size_in_bytes, "base_bytes": program.base_bytes,
        "launches_per_step": sum(c.times for c in costs) / program.per if program.per > 1 else None,
        "launches_per_layer": (sum(c.times for c in layer) / program.per / config.num_layers
                               if program.per > 1 else None),
        "custom_calls": _custom_calls(text),
        "largest": [(charged(c) / program.per, c.name, c.source) for c in largest],
    }


def step_figures(parts: list[dict]) -> dict:
    """The figures of a step that runs several programs (`measure` of each, the first's model
    counts the step's): FLOPs and bytes summed over their runs, the peak and temporaries the
    largest of theirs, compile times summed, custom calls of all; the programs' own figures
    under ``parts``. A program that does not fit is the step's answer."""
    if len(parts) == 1:
        return parts[0]
    refused = [p for p in parts if "does_not_fit" in p]
    if refused:
        return refused[0]
    first = parts[0]
    calls: dict[str, int] = {}
    for p in parts:
        for name, n in p["custom_calls"].items():
            calls[name] = calls.get(name, 0) + n
    return first | {
        "compile_s": round(sum(p["compile_s"] for p in parts), 1),
        "flops": sum(p["flops"] for p in parts), "bytes": sum(p["bytes"] for p in parts),
        "peak_bytes": max(p["peak_bytes"] for p in parts),
        "temp_bytes": max(p["temp_bytes"] for p in parts), "custom_calls": calls,
        "largest": sorted((x for p in parts for x in p["largest"]), key=lambda x: -x[0])[
            :len(first["largest"])],
        "parts": [{k: v for k, v in p.items() if k != "largest"} for p in parts]}
