"""`aot_report.py`'s lines: a program's or a step's figures (`aot.counting`) as text."""
from __future__ import annotations


def _size(x: float | None, unit: str = "B") -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def report(name: str, r: dict, memory: int | None) -> str:
    if "does_not_fit" in r:
        return (f"{name}: {r['note']}; compile {r['compile_s']:.1f} s\n  does not fit (base "
                f"{_size(r['base_bytes'])}): {r['does_not_fit']}")
    lines = [f"{name}: {r['note']}; compile {r['compile_s']:.1f} s",
             f"  flops  {_size(r['flops'], 'FLOP')} = {_ratio(r['flops'], r['model_flops'])} the "
             f"model's {_size(r['model_flops'], 'FLOP')}"
             + (f", {_ratio(r['flops'], r['computed_flops'])} its count on every token computed"
                if r["computed_flops"] else "")
             + (f" ({r['flops_note']})" if r['flops_note'] else ""),
             f"  bytes  {_size(r['bytes'])}" + (f" = {_ratio(r['bytes'], r['least_bytes'])} the least "
                                               f"{_size(r['least_bytes'])}" if r['least_bytes'] else "")
             + (f" ({r['bytes_note']})" if r['bytes_note'] else ""),
             f"  memory peak {_size(r['peak_bytes'])} = {_ratio(r['peak_bytes'], r['base_bytes'])} "
             f"the base {_size(r['base_bytes'])}, temp {_size(r['temp_bytes'])}"
             + (f"; {r['peak_bytes'] / memory:.0%} of the device's {_size(memory)}" if memory else "")]
    if r["launches_per_step"] is not None:
        lines.append(f"  launches per step {r['launches_per_step']:.0f} ({r['launches_per_layer']:.0f} "
                     "per layer)")
    lines.append("  custom calls " + (", ".join(f"{k} x{v}" for k, v in sorted(r["custom_calls"].items()))
                                      or "none"))
    for p in r.get("parts", []):
        lines.append(f"  {p['name']}: {p['runs']} run(s), compile {p['compile_s']:.1f} s; "
                     f"flops {_size(p['flops_per_run'], 'FLOP')} a run, {_size(p['flops'], 'FLOP')} "
                     f"in all; peak {_size(p['program_peak_bytes'])} + {_size(p['beside_bytes'])} "
                     f"held beside it")
    lines += [f"    {_size(moved):>10}  {name} ({source})" for moved, name, source in r["largest"]]
    return "\n".join(lines)
