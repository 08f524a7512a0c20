"""What a compiled XLA program does, read from its optimized HLO text: the bytes it moves, the
matmul FLOPs it computes and the kernels it launches, with loops multiplied out.

XLA's own cost analysis (`compiled.cost_analysis()`, or XLA's generic count of a module) counts a
loop's body once whatever its trip count, and counts a scatter, even one done in place, and a
gather fused into another op as touching their whole operand: for a decode step whose layers run
in a loop and whose keys and values live in a page pool updated in place and gathered from, that
is neither the step's traffic nor a bound on it. `costs` reads the compiled program with other
rules: a loop's body counts once per iteration (loops with a known trip count, such as the
layer loop, which XLA:GPU annotates and whose condition a TPU's program leaves as `i < N`;
others `unknown_trips` times); a gather or slice reads the bytes it takes (not its
whole operand); an in-place scatter or update writes its update. Everything else reads its
operands and writes its output, as in XLA's count; what a cache would spare is not modelled.
On a TPU only device memory (HBM) counts: an array its compiler placed in vector memory (VMEM)
moves nothing there, and an asynchronous copy into it (`copy-start`) reads its source once.

FLOPs are those of the matmuls only (`dot`, inside fusions too, and cuBLAS calls): 2 x the
output's elements x the contracted size; a TPU's compiler writes its matmuls as `convolution`s,
counted alike (2 x batch x output features x input features x the window positions that meet
the input, padding excluded); elementwise work is not counted, and neither is a
custom call's (cuDNN attention, Pallas kernels): their callers count those by hand. A kernel
launch is each instruction the program runs at the top level of its entry computation, a loop
body or a called computation (a fusion, a custom call, a copy, ...), as XLA:GPU runs them
without command buffers; a loop's condition counts too.
"""
from __future__ import annotations

import dataclasses
import math
import re

_SIZES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "partition-id", "replica-id"}
_READS_PART = {"gather", "dynamic-slice", "slice"}
_IN_PLACE = {"scatter": -1, "dynamic-update-slice": 1}  # opcode -> index of the update operand
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\((.*?)\)(?:, (.*))?$")
_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul")


def _dims(shape: str) -> list[list[int]]:
    """The dimensions of each array in an HLO shape (one for an array, several for a tuple)."""
    return [[int(d) for d in filter(None, dims.split(","))]
            for _, dims in re.findall(r"([a-z]+\d*[a-z\d]*)\[([\d,]*)\]", shape)]


def _nbytes(shape: str) -> int:
    """Bytes of the arrays of an HLO shape that live in device memory: a TPU's arrays in another
    memory space (its vector memory, `S(1)` in their layout; `S(2)`, `S(6)`) are not counted."""
    total = 0
    for dtype, dims, layout in re.findall(r"([a-z]+\d*[a-z\d]*)\[([\d,]*)\](\{[^}]*\})?", shape):
        if re.search(r"S\([1-9]\)", layout):
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _SIZES.get(dtype, 4)
    return total


def parse(text: str) -> tuple[dict, str]:
    """An HLO module's computations (name -> instructions) and its entry computation's name."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if head:
            current = comps.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            root, name, shape, op, operands, attrs = m.groups()
            source = re.search(r'op_name="([^"]*)"', attrs or "")
            target = re.search(r'custom_call_target="([^"]*)"', attrs or "")
            current.append({"root": bool(root), "name": name, "op": op, "shape": shape,
                            "args": operands, "operands": re.findall(r"%([\w.-]+)", operands),
                            "attrs": attrs or "", "bytes": _nbytes(shape),
                            "target": target.group(1) if target else "",
                            "source": source.group(1).rsplit("/", 1)[-1] if source else ""})
    return comps, entry


@dataclasses.dataclass(frozen=True)
class Cost:
    """One instruction the program runs: ``times`` per run of the program (loops multiplied
    out), each time moving ``bytes`` and computing ``flops`` (matmuls); ``loops`` are the loops
    it runs in, outermost first, as (body, trip count or None where not known at compile time);
    ``target`` is a custom call's; ``out`` the bytes of its output."""

    name: str
    op: str
    source: str
    target: str
    times: int
    bytes: int
    flops: int
    loops: tuple[tuple[str, int | None], ...]
    out: int


def costs(text: str, unknown_trips: int = 1) -> list[Cost]:
    """Every kernel-launching instruction of the compiled program `text` (`compiled.as_text()`)
    with its cost; a loop without a known trip count runs `unknown_trips` times."""
    comps, entry = parse(text)
    out = []
    _walk(comps, entry, out, 1, (), unknown_trips)
    return out


def bytes_moved(text: str) -> tuple[int, list[tuple[int, str, str]]]:
    """Bytes the compiled program `text` (`compiled.as_text()`) moves, and (bytes, instruction,
    the jax op it came from) per instruction, loops multiplied out, largest first."""
    parts = [(c.bytes * c.times, c.name, c.source) for c in costs(text)]
    return sum(p[0] for p in parts), sorted(parts, reverse=True)


def _callee(instr, key):
    return re.search(rf"\b{key}=%([\w.-]+)", instr["attrs"]).group(1)


def _walk(comps, comp, out, times, loops, unknown_trips) -> None:
    instrs = {i["name"]: i for i in comps[comp]}

    def size(name):
        return instrs[name]["bytes"] if name in instrs else 0

    for i in comps[comp]:
        op = i["op"]
        if op in _FREE:
            continue
        if op == "while":
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', i["attrs"])
            trips = int(trips.group(1)) if trips else _counted(comps[_callee(i, "condition")])
            n = trips if trips is not None else unknown_trips
            inner = loops + ((_callee(i, "body"), trips),)
            _walk(comps, _callee(i, "body"), out, times * n, inner, unknown_trips)
            _walk(comps, _callee(i, "condition"), out, times * (n + 1), inner, unknown_trips)
            continue
        if op == "call":
            _walk(comps, _callee(i, "to_apply"), out, times, loops, unknown_trips)
            continue
        if op == "conditional":  # the largest branch: an upper bound
            branches = re.findall(r"%([\w.-]+)", re.search(
                r"branch_computations=\{([^}]*)\}", i["attrs"]).group(1))
            runs = []
            for branch in branches:
                runs.append([])
                _walk(comps, branch, runs[-1], times, loops, unknown_trips)
            out.extend(max(runs, key=lambda r: sum(c.bytes * c.times for c in r)))
            continue
        flops = 0
        if op == "fusion":
            body = comps[_callee(i, "calls")]
            cost, flops = _fusion(comps, body, i["bytes"]), _flops(comps, body)
        elif op in _READS_PART:
            cost = 2 * i["bytes"] + sum(size(o) for o in i["operands"][1:])
        elif op in _IN_PLACE:
            cost = 2 * size(i["operands"][_IN_PLACE[op]])
        elif op == "copy-start":  # its output tuple holds the source too
            cost = sum(size(o) for o in i["operands"])
        elif op == "copy-done":  # the copy's bytes are counted at its start
            cost = 0
        else:
            cost = i["bytes"] + sum(size(o) for o in i["operands"])
            if op == "dot" or i["target"] in _GEMMS:
                flops = _dot_flops(i, [instrs[o] for o in i["operands"] if o in instrs])
            elif op == "convolution":
                flops = _conv_flops(i, [instrs[o] for o in i["operands"] if o in instrs])
        out.append(Cost(i["name"], op, i["source"], i["target"], times, cost, flops, loops,
                        i["bytes"]))


def _flops(comps, body: list) -> int:
    """Matmul FLOPs of a fused computation (nested fusions and calls included)."""
    by_name = {i["name"]: i for i in body}
    total = 0
    for i in body:
        if i["op"] == "dot":
            total += _dot_flops(i, [by_name[o] for o in i["operands"] if o in by_name])
        elif i["op"] == "convolution":
            total += _conv_flops(i, [by_name[o] for o in i["operands"] if o in by_name])
        for key in ("calls", "to_apply"):
            callee = re.search(rf"\b{key}=%([\w.-]+)", i["attrs"])
            if callee and i["op"] in ("fusion", "call"):
                total += _flops(comps, comps[callee.group(1)])
    return total


def _dot_flops(instr, operands) -> int:
    """2 x output elements x contracted size, of a `dot` or a cuBLAS call."""
    if not operands:
        return 0
    lhs = _dims(operands[0]["shape"])[0]
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr["attrs"])
    if contracting:
        axes = [int(a) for a in filter(None, contracting.group(1).split(","))]
    else:  # a cuBLAS call: its dot dimensions are in the backend config
        axes = [int(a) for a in re.findall(r'"(\d+)"', re.search(
            r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr["attrs"]).group(1))]
    output = _dims(instr["shape"])[0]
    return 2 * math.prod(output) * math.prod(lhs[a] for a in axes)


def _counted(condition: list) -> int | None:
    """N for a loop whose condition is `i < N` (i the loop's first element, N a constant): a
    TPU program's scans and fori loops, which count from 0; None for any other condition."""
    by_name = {i["name"]: i for i in condition}
    root = next(i for i in condition if i["root"])
    if root["op"] != "compare" or "direction=LT" not in root["attrs"]:
        return None
    index, bound = (by_name.get(o) for o in root["operands"][:2])
    if (index is None or bound is None or index["op"] != "get-tuple-element"
            or "index=0" not in index["attrs"] or bound["op"] != "constant"):
        return None
    return int(bound["args"]) if bound["args"].isdigit() else None


def _conv_flops(instr, operands) -> int:
    """2 x batch x output features x input features (per group) x, per spatial axis, the
    (output, window) positions that fall inside the input (not in its padding)."""
    if len(operands) < 2:
        return 0
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr["attrs"])
    lhs_labels, rhs_labels, out_labels = labels.groups()
    lhs, rhs = (_dims(o["shape"])[0] for o in operands[:2])
    out = _dims(instr["shape"])[0]
    groups = re.search(r"feature_group_count=(\d+)", instr["attrs"])
    in_features = lhs[lhs_labels.index("f")] // (int(groups.group(1)) if groups else 1)
    window = re.search(r"window=\{([^}]*)\}", instr["attrs"])
    window = window.group(1) if window else ""
    spatial = [c for c in out_labels if c.isdigit()]

    def per_axis(key, default):
        found = re.search(rf"\b{key}=(\S+)", window)
        return found.group(1).split("x") if found else [default] * len(spatial)

    pads, strides = per_axis("pad", "0_0"), per_axis("stride", "1")
    positions = 1
    for axis, pad, stride in zip(spatial, pads, strides):
        size, width = lhs[lhs_labels.index(axis)], rhs[rhs_labels.index(axis)]
        low, stride = int(pad.split("_")[0]), int(stride)
        positions *= sum(max(0, min(width, size + low - o * stride) - max(0, low - o * stride))
                         for o in range(out[out_labels.index(axis)]))
    return 2 * out[out_labels.index("b")] * out[out_labels.index("f")] * in_features * positions


def _fusion(comps, body: list, out_bytes: int) -> int:
    total = sum(_read(comps, body, i["name"]) for i in body if i["op"] == "parameter")
    root = next(i for i in body if i["root"])
    in_place = root if root["op"] in _IN_PLACE else None
    if in_place is None:
        return total + out_bytes
    by_name = {i["name"]: i for i in body}
    return total + by_name[in_place["operands"][_IN_PLACE[in_place["op"]]]]["bytes"]


def _read(comps, body: list, name: str) -> int:
    """Bytes of fused parameter (or bitcast of one) `name` of the fused computation `body` that
    its users read: a slice or gather of it, its share in a nested fusion (a TPU's compiler
    slices a layer's weights out of the stacked ones in one), nothing as the buffer a scatter
    updates in place; else all of it."""
    by_name = {i["name"]: i for i in body}
    root = next(i for i in body if i["root"])
    if root["name"] == name:  # passed on whole (a nested fusion that only bitcasts it)
        return by_name[name]["bytes"]
    in_place = root if root["op"] in _IN_PLACE else None
    total = 0
    for u in (i for i in body if name in i["operands"]):
        if u["op"] == "bitcast":
            total += _read(comps, body, u["name"])
        elif u["op"] in _READS_PART and u["operands"][0] == name:
            total += u["bytes"]
        elif u["op"] == "fusion" and u["operands"].count(name) == 1:
            nested = comps[_callee(u, "calls")]
            index = u["operands"].index(name)
            param = next(i for i in nested if i["op"] == "parameter"
                         and i["args"].strip() == str(index))
            total += _read(comps, nested, param["name"])
        elif u is not in_place or u["operands"][0] != name:
            return by_name[name]["bytes"]
    return total
