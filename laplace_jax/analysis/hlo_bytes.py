"""Bytes a compiled XLA program reads and writes in memory per call, from its HLO text.

Read from `jitted.lower(...).compile().as_text()`: nothing runs or allocates. Each instruction of a computation
that executes (the entry, while bodies and conditions, conditional branches, `call` targets) is one pass over
memory: it reads its operands and writes its result, except
  - free ops (parameter, constant, get-tuple-element, tuple, bitcast, control flow) move nothing;
  - slices, dynamic slices and gathers read only what they return (plus their indices);
  - dynamic-update-slice and scatter work in place: they read and write only the update;
  - a fusion is one pass, judged by its fused computation: a parameter consumed only through slices or
    gathers reads those pieces, a parameter that is operand 0 of an in-place dynamic-update-slice (the
    fusion's root or a root tuple element) is not read, and that output writes only the update.
An instruction in a while body counts once per iteration (XLA's known_trip_count); one in a conditional
counts once per branch (an upper bound). XLA's own `cost_analysis()` counts a loop body once.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from laplace_jax.analysis.hlo_traffic import array_bytes, computations, execution_counts

_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_PARAM_INDEX = re.compile(r"^(\d+)\)")

FREE = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "while",
  "conditional",
  "call",
  "after-all",
  "opt-barrier",
  "partition-id",
  "replica-id",
  "add-dependency",
  "domain",
  "async-start",
  "async-update",
  "async-done",
  "copy-done",
}  # an async op's work is its computation
SLICING = {"slice", "dynamic-slice", "gather"}
IN_PLACE = {"dynamic-update-slice", "scatter"}


@dataclasses.dataclass(frozen=True)
class Instr:
  name: str
  type_text: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str
  root: bool


@dataclasses.dataclass(frozen=True)
class OpTraffic:
  computation: str
  name: str
  opcode: str
  read_bytes: int  # per execution
  written_bytes: int
  count: int  # executions per program run
  op_name: str  # jax metadata: the named scopes that produced it

  @property
  def total_bytes(self) -> int:
    return (self.read_bytes + self.written_bytes) * self.count


def _split_operands(text: str) -> tuple[tuple[str, ...], str]:
  """'%a, %b), attrs' -> (('a', 'b'), 'attrs'): operands up to the matching parenthesis."""
  depth, i = 1, 0
  while i < len(text) and depth:
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    i += 1
  inner, attrs = text[: i - 1], text[i:]
  names, depth, start = [], 0, 0
  for j, ch in enumerate(inner + ","):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    elif ch == "," and depth == 0:
      tok = re.sub(r"/\*.*?\*/", "", inner[start:j]).strip()
      m = re.search(r"%?([\w.\-]+)$", tok)
      if tok and m:
        names.append(m.group(1))
      start = j + 1
  return tuple(names), attrs


def parse_instructions(lines: list[str]) -> list[Instr]:
  out = []
  for line in lines:
    m = _INSTR.match(line)
    if m:
      root, name, type_text, opcode, rest = m.groups()
      operands, attrs = _split_operands(rest)
      out.append(
        Instr(name, type_text, opcode, operands, attrs if opcode != "parameter" else rest, bool(root))
      )
  return out


def _bytes(type_text: str) -> int:
  return sum(array_bytes(type_text))


def _fusion_traffic(fused: list[Instr], operand_bytes: list[int], result_bytes: int) -> tuple[int, int]:
  """(read, written) bytes of one fusion, from its fused computation (see the module docstring)."""
  by_name = {i.name: i for i in fused}
  users: dict[str, list[tuple[Instr, int]]] = defaultdict(list)
  for ins in fused:
    for pos, o in enumerate(ins.operands):
      users[o].append((ins, pos))

  def final_uses(name):
    """Users of `name`, looking through bitcasts."""
    out = []
    for ins, pos in users[name]:
      out.extend(final_uses(ins.name) if ins.opcode == "bitcast" else [(ins, pos)])
    return out

  root = next((i for i in fused if i.root), fused[-1])
  outputs = [by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
  in_place_bases = {}
  for out in outputs:
    src = out
    while src.opcode == "bitcast":
      src = by_name[src.operands[0]]
    if src.opcode in IN_PLACE:
      in_place_bases[src.name] = src

  read = 0
  for ins in fused:
    if ins.opcode != "parameter":
      continue
    pm = _PARAM_INDEX.match(ins.attrs)
    if pm is None:
      raise ValueError(f"fused parameter %{ins.name} has no index in `{ins.attrs}`")
    idx = int(pm.group(1))
    uses = final_uses(ins.name)
    full = operand_bytes[idx] if idx < len(operand_bytes) else _bytes(ins.type_text)
    sliced = [u for u, pos in uses if u.opcode in SLICING and pos == 0]
    in_place = [u for u, pos in uses if u.name in in_place_bases and pos == 0]
    if uses and len(sliced) + len(in_place) == len(uses):
      # Read only through slices; a buffer updated in place is not read (the update is counted below).
      read += min(full, sum(_bytes(u.type_text) for u in sliced))
    else:
      read += full

  written = 0
  for out in outputs:
    src = out
    while src.opcode == "bitcast":
      src = by_name[src.operands[0]]
    if src.name in in_place_bases and by_name[src.operands[0]].opcode == "parameter":
      written += _update_bytes(src, by_name)
    else:
      written += _bytes(out.type_text)
  return read, written


def _update_bytes(ins: Instr, by_name: dict[str, Instr]) -> int:
  update = by_name[ins.operands[1] if ins.opcode == "dynamic-update-slice" else ins.operands[2]]
  return _bytes(update.type_text)


def memory_traffic(hlo_text: str) -> list[OpTraffic]:
  """Every instruction that moves memory in a compiled HLO module, with its bytes and executions per call."""
  raw, entry = computations(hlo_text)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text: pass `jitted.lower(...).compile().as_text()`.")
  comps = {name: parse_instructions(lines) for name, lines in raw.items()}
  counts = execution_counts(raw, entry, condition_runs_once_more=True, follow_fused=False)
  out = []
  for comp, n in counts.items():
    types = {i.name: i.type_text for i in comps[comp]}
    for ins in comps[comp]:
      if ins.opcode in FREE:
        continue
      op_bytes = [_bytes(types.get(o, "")) for o in ins.operands]
      result = _bytes(ins.type_text)
      if ins.opcode == "fusion":
        cm = _CALLS.search(ins.attrs)
        if cm is None:
          raise ValueError(f"fusion %{ins.name} in {comp} names no fused computation (`calls=`)")
        callee = cm.group(1)
        read, written = _fusion_traffic(comps[callee], op_bytes, result)
      elif ins.opcode in SLICING:
        read, written = result + sum(op_bytes[1:]), result
      elif ins.opcode == "dynamic-update-slice":
        read, written = sum(op_bytes[1:]), op_bytes[1]
      elif ins.opcode == "scatter":
        read, written = sum(op_bytes[1:]), op_bytes[2]
      elif ins.opcode == "copy-start":  # its result tuple holds the destination and the source
        read, written = op_bytes[0], op_bytes[0]
      else:
        read, written = sum(op_bytes), result
      op = re.search(r'op_name="([^"]*)"', ins.attrs)
      out.append(OpTraffic(comp, ins.name, ins.opcode, read, written, n, op.group(1) if op else ""))
  return out


def total_bytes(ops: list[OpTraffic]) -> int:
  """Bytes read plus written per program run."""
  return sum(o.total_bytes for o in ops)
