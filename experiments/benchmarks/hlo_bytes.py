"""Bytes a compiled XLA program moves, read from its optimized HLO text.

XLA's own cost analysis (`compiled.cost_analysis()["bytes accessed"]`) counts a loop's body once
whatever its trip count, and counts a scatter, even one done in place, and a gather fused into
another op as touching their whole operand: for a decode step whose layers run in a loop and
whose keys and values live in a page pool updated in place and gathered from, that is neither
the step's traffic nor a bound on it. `bytes_moved` reads the same compiled program with three
different rules: a loop's body counts once per iteration (loops with a known trip count: the
layer loop), a gather or slice reads the bytes it takes (not its whole operand), and an in-place
scatter or update writes its update. Everything else reads its operands and writes its output,
as in XLA's count; what a cache would spare is not modelled.
"""
from __future__ import annotations

import re

_SIZES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "partition-id", "replica-id"}
_READS_PART = {"gather", "dynamic-slice", "slice"}
_IN_PLACE = {"scatter": -1, "dynamic-update-slice": 1}  # opcode -> index of the update operand
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\((.*?)\)(?:, (.*))?$")


def _nbytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", shape):
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
            current.append({"root": bool(root), "name": name, "op": op,
                            "operands": re.findall(r"%([\w.-]+)", operands),
                            "attrs": attrs or "", "bytes": _nbytes(shape),
                            "source": source.group(1).rsplit("/", 1)[-1] if source else ""})
    return comps, entry


def bytes_moved(text: str) -> tuple[int, list[tuple[int, str, str]]]:
    """Bytes the compiled program `text` (`compiled.as_text()`) moves, and (bytes, instruction,
    the jax op it came from) per instruction, loops multiplied out, largest first."""
    comps, entry = parse(text)
    parts = []
    total = _computation(comps, entry, parts, 1)
    return total, sorted(parts, reverse=True)


def _callee(instr, key):
    return re.search(rf"\b{key}=%([\w.-]+)", instr["attrs"]).group(1)


def _computation(comps, comp, parts, scale) -> int:
    instrs = {i["name"]: i for i in comps[comp]}

    def size(name):
        return instrs[name]["bytes"] if name in instrs else 0

    total = 0
    for i in comps[comp]:
        op = i["op"]
        if op in _FREE:
            continue
        if op == "while":
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', i["attrs"])
            n = int(trips.group(1)) if trips else 1
            total += n * _computation(comps, _callee(i, "body"), parts, scale * n)
            continue
        if op == "call":
            total += _computation(comps, _callee(i, "to_apply"), parts, scale)
            continue
        if op == "fusion":
            cost = _fusion(comps[_callee(i, "calls")], i["bytes"])
        elif op in _READS_PART:
            cost = 2 * i["bytes"] + sum(size(o) for o in i["operands"][1:])
        elif op in _IN_PLACE:
            cost = 2 * size(i["operands"][_IN_PLACE[op]])
        else:
            cost = i["bytes"] + sum(size(o) for o in i["operands"])
        total += cost
        parts.append((cost * scale, i["name"], i["source"]))
    return total


def _fusion(body: list, out_bytes: int) -> int:
    by_name = {i["name"]: i for i in body}
    users = {}
    for i in body:
        for o in i["operands"]:
            users.setdefault(o, []).append(i)
    root = next(i for i in body if i["root"])
    in_place = root if root["op"] in _IN_PLACE else None

    def read(name):
        """Bytes of fused parameter (or bitcast of one) `name` that its users read."""
        total = 0
        for u in users.get(name, []):
            if u["op"] == "bitcast":
                total += read(u["name"])
            elif u["op"] in _READS_PART and u["operands"][0] == name:
                total += u["bytes"]
            elif u is not in_place or u["operands"][0] != name:
                return by_name[name]["bytes"]
        return total

    total = sum(read(i["name"]) for i in body if i["op"] == "parameter")
    if in_place is None:
        return total + out_bytes
    return total + by_name[in_place["operands"][_IN_PLACE[in_place["op"]]]]["bytes"]
