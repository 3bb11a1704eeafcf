"""Parsing the text of a compiled XLA program: computations, instructions, loop trip counts.

The text is ``compiled.as_text()`` (optimized HLO). Only what :mod:`jaxmp.hlo.collectives`
needs is modelled: each instruction's name, shape, opcode, operands, attributes and called
computations, and a small symbolic evaluator that solves a ``while`` loop's trip count from its
condition, initial value and step when XLA does not state it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

_DTYPE_BITS = {"pred": 8, "token": 0, "bf16": 16, "tf32": 32, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}
_LOOP = ("loop",)  # symbolic value of a while loop's state tuple


def _dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    m = re.fullmatch(r"[suf](\d+)(?:e\d+m\d+\w*)?", dtype)  # s32, u4, f16, f8e4m3fn, f4e2m1fn ...
    if not m:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(m.group(1))


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape: an array ("f32[8,128]{1,0}", "pred[]") or a tuple of them (summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        n = math.prod(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())
        total += math.ceil(n * _dtype_bits(dtype) / 8)
    return total


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    args: str  # raw text between the opcode's parentheses
    operands: list[tuple[str, str | None]]  # (name, inline shape or None)
    attrs: str  # attributes with double-quoted strings blanked out
    raw_attrs: str
    callees: list[tuple[str, str]]  # (attribute, computation)


def _close(s: str, i: int) -> int:
    """Index just past the bracket that closes s[i]."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "([{":
            depth += 1
        elif s[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced brackets in {s!r}")


_CALL_ATTR = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|true_computation|"
                        r"false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


_OPERAND = re.compile(r"(?:([a-z]\w*\[[^\]]*\](?:\{[^}]*\})?)\s+)?%([\w.\-]+)")


def parse_instr(line: str) -> Instr | None:
    """One `[ROOT] %name = shape opcode(operands), attrs` line; None if it is not one."""
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    try:
        end = _close(rest, 0) if rest.startswith("(") else len(rest.split(" ", 1)[0])
        shape, rest = rest[:end], rest[end:].lstrip()
        op = re.match(r"([\w\-]+)\(", rest)
        close = _close(rest, op.end() - 1) if op else 0
    except ValueError:
        return None
    if not op:
        return None
    args = re.sub(r"/\*.*?\*/", "", rest[op.end():close - 1])
    operands = [(name, shp or None) for shp, name in _OPERAND.findall(args)]
    raw = rest[close:]
    attrs = re.sub(r'"(?:[^"\\]|\\.)*"', '""', raw)
    callees = [(a, c.strip().lstrip("%")) for a, v in _CALL_ATTR.findall(attrs)
               for c in v.strip("{}").split(",") if c.strip()]
    return Instr(m.group(1), shape, op.group(1), args, operands, attrs, raw, callees)


class HloModule:
    """Computations of one HLO module, plus the symbolic evaluation used to find trip counts."""

    def __init__(self, text: str):
        self.comps: dict[str, dict[str, Instr]] = {}
        self.roots: dict[str, str] = {}
        self.entry: str | None = None
        header = re.search(r"^HloModule\b.*$", text, re.M)
        found = re.findall(r"\b(?:num_partitions|replica_count)=(\d+)", header[0] if header else "")
        self.num_devices = math.prod(map(int, found)) if found else None  # partitions x replicas
        current = None
        for line in text.splitlines():
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                m = re.match(r"(ENTRY\s+)?%?([\w.\-]+)", line)
                if m and m.group(2) != "HloModule":
                    current = m.group(2)
                    self.comps[current] = {}
                    self.entry = current if m.group(1) else self.entry
                continue
            if line.startswith("}"):
                current = None
            elif current is not None and (ins := parse_instr(line)):
                self.comps[current][ins.name] = ins
                if line.lstrip().startswith("ROOT"):
                    self.roots[current] = ins.name

    def eval(self, comp: str, name: str, env: dict[int, Any] | None, depth: int = 0) -> Any:
        """Fold `name` to ("c", int), ("i", k) = loop element k, ("t", [...]), an op tuple or None."""
        ins = self.comps.get(comp, {}).get(name)
        if ins is None or depth > 64:
            return None
        op = ins.opcode
        sub = lambda i: self.eval(comp, ins.operands[i][0], env, depth + 1)  # noqa: E731
        if op == "constant":
            return ("c", int(ins.args)) if re.fullmatch(r"\s*-?\d+\s*", ins.args) else None
        if op == "parameter":
            return (env or {}).get(int(ins.args))
        if op == "get-tuple-element":
            m = re.search(r"index=(\d+)", ins.attrs)
            v, k = (sub(0), int(m[1])) if m else (None, 0)
            if v == _LOOP:
                return ("i", k)
            return v[1][k] if v and v[0] == "t" and k < len(v[1]) else None
        if op == "tuple":
            return ("t", [sub(i) for i in range(len(ins.operands))])
        if op in ("copy", "convert", "bitcast", "reshape", "opt-barrier") and ins.operands:
            return sub(0)
        if op in ("fusion", "call") and ins.callees:
            callee = ins.callees[0][1]
            inner = {i: sub(i) for i in range(len(ins.operands))}
            return self.eval(callee, self.roots.get(callee, ""), inner, depth + 1)
        if op in ("add", "subtract", "compare") and len(ins.operands) == 2:
            a, b = sub(0), sub(1)
            if op == "compare":
                d = re.search(r"direction=(\w+)", ins.attrs)
                return ("cmp", d.group(1) if d else "", a, b)
            return (op, a, b)
        return None

    def trip_count(self, comp: str, ins: Instr) -> int | None:
        """known_trip_count from backend_config, else solve `i < N` from condition, init, step."""
        known = re.search(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)', ins.raw_attrs)
        if known:
            return int(known.group(1))
        called = dict(ins.callees)
        cond, body = called.get("condition"), called.get("body")
        c = self.eval(cond, self.roots.get(cond, ""), {0: _LOOP}) if cond else None
        if not c or c[0] != "cmp" or None in c[2:]:
            return None
        _, d, a, b = c
        state = self.eval(comp, ins.operands[0][0], None) if ins.operands else None
        start = state[1] if state and state[0] == "t" else []
        root = self.eval(body, self.roots.get(body, ""), {0: _LOOP}) if body else None
        updated = root[1] if root and root[0] == "t" else []

        def invariant(v: Any) -> Any:  # a bound the loop carries unchanged: its start value
            if v and v[0] == "i" and v[1] < min(len(start), len(updated)) and \
                    updated[v[1]] == v and start[v[1]] and start[v[1]][0] == "c":
                return start[v[1]]
            return v

        if a[0] == "i" and b[0] == "i":  # i < N with N carried (e.g. behind a barrier)
            bound = invariant(b)
            a, b = (a, bound) if bound[0] == "c" else (invariant(a), b)
        if a[0] == "c" and b[0] == "i":
            a, b, d = b, a, _FLIP.get(d, d)
        if a[0] != "i" or b[0] != "c":
            return None
        k, limit = a[1], b[1]
        init = start[k] if k < len(start) else None
        upd = updated[k] if k < len(updated) else None
        step = None
        if upd and upd[0] in ("add", "subtract") and ("i", k) in upd[1:]:
            other = upd[2] if upd[1] == ("i", k) else upd[1]
            if other and other[0] == "c" and (upd[0] == "add" or upd[1] == ("i", k)):
                step = other[1] if upd[0] == "add" else -other[1]
        if not init or init[0] != "c" or not step:
            return None
        span = (limit - init[1]) if step > 0 else (init[1] - limit)
        s = abs(step)
        if (d, step > 0) in (("LT", True), ("GT", False)):
            return max(0, -(-span // s))
        if (d, step > 0) in (("LE", True), ("GE", False)):
            return max(0, span // s + 1)
        if d == "NE" and span >= 0 and span % s == 0:
            return span // s
        return None
