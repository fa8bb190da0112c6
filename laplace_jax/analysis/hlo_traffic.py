"""Bytes each device sends and receives in the collectives of a compiled XLA program (its HLO text).

Read from `jitted.lower(...).compile().as_text()`, so nothing needs to run or allocate. Per collective, with
G devices in its replica group and S the bytes of the per-device buffer, the bandwidth-optimal (ring /
pairwise) volumes each device sends, and also receives:
  all-to-all      S·(G−1)/G      (S = its operand = its result)
  all-gather      R·(G−1)/G      (R = the gathered result)
  reduce-scatter  S·(G−1)/G      (S = the unreduced operand = G·result)
  all-reduce      2·S·(G−1)/G    (a reduce-scatter then an all-gather)
  collective-permute  S
A collective inside a while loop counts once per iteration (XLA's known_trip_count); one inside a
conditional counts once per branch (an upper bound).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "s4": 1,
  "u4": 1,
}
KINDS = (
  "all-to-all",
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "collective-permute",
  "ragged-all-to-all",
  "collective-broadcast",
)

_OPCODE = re.compile(
  r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+("
  + "|".join(k + suffix for k in sorted(KINDS, key=len, reverse=True) for suffix in ("-start", ""))
  + r")\((.*)$"
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEES = re.compile(r"(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_RUNS_ITS_CALLEE = re.compile(
  r"\s(?:call|async-start)\("
)  # ops whose called computation runs as instructions


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str  # one of KINDS
  name: str  # HLO instruction name
  buffer_bytes: int  # S (or R for all-gather) as in the module docstring
  group_size: int
  count: int  # executions per program run (while-loop trip counts multiplied in)
  op_name: str  # jax metadata op_name: the named scopes that produced it
  dtype: str = ""  # element type of its largest array (e.g. "u16" for bf16 bits, "f32")

  @property
  def sent_bytes(self) -> float:
    g = self.group_size
    if self.kind == "collective-permute":
      return float(self.buffer_bytes) * self.count
    factor = 2.0 if self.kind == "all-reduce" else 1.0
    return factor * self.buffer_bytes * (g - 1) / g * self.count

  @property
  def received_bytes(self) -> float:
    return self.sent_bytes


def array_bytes(type_text: str) -> list[int]:
  out = []
  for dtype, dims in _ARRAY.findall(type_text):
    size = 1
    for d in filter(None, dims.split(",")):
      size *= int(d)
    out.append(size * DTYPE_BYTES.get(dtype, DTYPE_BYTES.get(dtype[:2], 1)))
  return out


def _largest_dtype(type_text: str) -> str:
  arrays = _ARRAY.findall(type_text)
  sizes = array_bytes(type_text)
  return arrays[sizes.index(max(sizes))][0] if arrays else ""


def _group_size(attrs: str, n_devices: int) -> int:
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
  if m:
    return len(m.group(1).split(","))
  return n_devices


def _buffer_bytes(kind: str, start: bool, type_text: str, group: int) -> int:
  arrays = array_bytes(type_text)
  if not arrays:
    return 0
  if kind == "all-to-all" or kind == "ragged-all-to-all":
    return sum(arrays) if not start else arrays[-1]
  if kind == "all-gather":
    return max(arrays)  # the gathered result
  if kind == "reduce-scatter":
    return group * (arrays[-1] if start else sum(arrays))  # the unreduced operand
  return arrays[0] if start else sum(arrays)


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  """Each computation's body lines by name, and the ENTRY computation's name (None when there is none)."""
  comps: dict[str, list[str]] = {}
  entry: str | None = None
  current: str | None = None
  for line in hlo_text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
    elif line.strip() == "}":
      current = None
    else:
      comps[current].append(line)
  return comps, entry


def execution_counts(
  comps: dict[str, list[str]],
  entry: str,
  *,
  condition_runs_once_more: bool = False,
  follow_fused: bool = True,
) -> dict[str, int]:
  """How often each computation runs per program run: the entry once, a while body k times (XLA's
  known_trip_count, 1 if unknown), its condition k times (k + 1 with condition_runs_once_more: it also runs
  to end the loop), conditional branches and called computations as often as their caller. follow_fused=False
  leaves out the computations a fusion or a reduction applies (they are not run as instructions of their own);
  `call` and `async-start` targets are followed either way. `comps` as returned by `computations`."""
  counts: dict[str, int] = defaultdict(int)
  stack = [(entry, 1)]
  while stack:
    name, n = stack.pop()
    if name not in comps:
      continue
    counts[name] += n
    for line in comps[name]:
      trip = _TRIP.search(line)
      k = int(trip.group(1)) if trip else 1
      for role, callee in _CALLEES.findall(line):
        if role in ("body", "condition"):
          stack.append((callee, n * (k + (role == "condition" and condition_runs_once_more))))
        elif follow_fused or role.endswith("_computation") or _RUNS_ITS_CALLEE.search(line):
          stack.append((callee, n))
      for group in _BRANCHES.findall(line):
        for callee in group.split(","):
          stack.append((callee.strip().lstrip("%"), n))
  return counts


def parse_collectives(hlo_text: str, n_devices: int) -> list[Collective]:
  """Every collective in a compiled HLO module, with how often it runs per call."""
  comps, entry = computations(hlo_text)
  counts = execution_counts(comps, entry) if entry else defaultdict(lambda: 1)
  out = []
  for comp, lines in comps.items():
    for line in lines:
      m = _OPCODE.match(line)
      if not m or not counts.get(comp, 0):
        continue
      name, type_text, opcode, rest = m.groups()
      start = opcode.endswith("-start")
      kind = opcode[: -len("-start")] if start else opcode
      group = _group_size(rest, n_devices)
      op = re.search(r'op_name="([^"]*)"', rest)
      out.append(
        Collective(
          kind,
          name,
          _buffer_bytes(kind, start, type_text, group),
          group,
          counts[comp],
          op.group(1) if op else "",
          _largest_dtype(type_text),
        )
      )
  return out


def traffic_by_kind(collectives: list[Collective], op_name_filter: str | None = None) -> dict[str, dict]:
  """{kind: {count, sent_bytes, received_bytes}} per device, optionally only ops whose op_name matches."""
  table: dict[str, dict] = {}
  for c in collectives:
    if op_name_filter and op_name_filter not in c.op_name:
      continue
    row = table.setdefault(c.kind, {"count": 0, "sent_bytes": 0.0, "received_bytes": 0.0})
    row["count"] += c.count
    row["sent_bytes"] += c.sent_bytes
    row["received_bytes"] += c.received_bytes
  return table


def total_bytes(collectives: list[Collective], op_name_filter: str | None = None) -> float:
  """Bytes sent plus received per device per call."""
  return sum(
    r["sent_bytes"] + r["received_bytes"] for r in traffic_by_kind(collectives, op_name_filter).values()
  )
