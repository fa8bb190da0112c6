"""Conformance of a lowered program (its StableHLO text) with jax-neuronx's documented limits.

    report = neuron_check.check(jax.jit(f).lower(*args).as_text())
    report.violations   # [Violation(rule, line, excerpt, message)], empty when the program conforms

Works on any program's text, so users can check their own. Rules (docs/NEURON.md gives each one's source):
  cond           no `stablehlo.case` / `stablehlo.if` (lax.cond, lax.switch)
  while          every while loop counts a constant-initialised counter by a constant step to a constant bound
                 (what lax.scan and fori_loop with Python-int bounds emit)
  threefry       no Threefry (a threefry2x32 function or custom call, or its inlined key-schedule constant)
  dtype          value element types within Trn2's: f32, bf16, f16, fp8 (e4m3, e5m2), i8/ui8, i32/ui32, i1.
                 Only the types of ops' values count (attributes such as replica groups or padding are i64
                 by construction); rng_bit_generator's ui64[2] state (jax's rbg/unsafe_rbg) is exempt.
  collective     all_gather, all_reduce, reduce_scatter, all_to_all, collective_permute move f32 or bf16 only.
                 Integer operands count as violations too: Trn2 reduces in FP32 (integers past 2^24 round),
                 and a 32-bit integer can travel as f32 bits (bitcast_convert) at the same cost.
  variadic_reduce  no reduce over several operands, except argmax/argmin's (value, iota index) pair
  sort           a sort comparator returns one LT/LE/GT/GE compare (so one key)
  custom_call    only the partitioner's markers (Sharding, SPMDFullToShardShape, SPMDShardToFullShape) and
                 neuronx-cc's AwsNeuron* targets (NCC_EHCA005)
  power          `power` only with a constant exponent
Reported, never failing: the distinct reduce_window shapes and the distinct replica-group sizes.

What this cannot see: collectives the SPMD partitioner inserts when the program is compiled (only those the
program writes, e.g. inside shard_map, are in the lowered text), scatter/gather index ranges, and anything
the Neuron compiler itself decides (memory, tiling). docs/NEURON.md lists what only a Trainium host shows.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import re

ALLOWED_TYPES = frozenset(
  {"f32", "bf16", "f16", "f8E4M3FN", "f8E4M3", "f8E5M2", "i1", "i8", "ui8", "i32", "ui32"}
)
COLLECTIVE_TYPES = frozenset({"f32", "bf16"})
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute")
ALLOWED_CUSTOM_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
SORT_DIRECTIONS = frozenset({"LT", "LE", "GT", "GE"})
THREEFRY_PARITY = "466688986"  # 0x1BD11BDA, Threefry's key-schedule constant: the inlined hash's signature

FIXES = {
  "cond": "lax.cond / lax.switch lower to a conditional, which jax-neuronx does not support (and an SPMD "
  "program must be the same on every device): compute the branches and pick with jnp.where, or make "
  "the choice static (a Python value).",
  "while": "jax-neuronx supports only while loops with a static trip count: use lax.scan, or fori_loop with "
  "Python-int bounds; a data-dependent loop needs a fixed bound and a mask.",
  "threefry": "Threefry is not fully supported by jax-neuronx: set jax_default_prng_impl to 'rbg' (--prng rbg) "
  "and draw without split/fold_in inside compiled steps ('rbg' still runs Threefry there); "
  "per-row streams need a counter-based hash such as serve/slots/philox.py (vmapped rbg/unsafe_rbg "
  "draws every row from the first key on jax 0.10.0).",
  "dtype": "not a Trn2 data type (FP32, TF32, BF16, FP16, FP8, INT8/UINT8, INT32/UINT32): keep jax_enable_x64 "
  "off and compute in int32/uint32 or f32 (bf16 bits move as bf16, not uint16).",
  "collective": "collectives on Neuron move f32/bf16 (all-reduce and reduce-scatter compute in FP32): send "
  "bf16 or f32 directly; bitcast 32-bit integers to f32 for pure data movement.",
  "variadic_reduce": "jax-neuronx does not support variadic reductions (argmax's (value, index) pair is the "
  "exception): reduce each operand on its own (e.g. max, then a masked sum).",
  "sort": "jax-neuronx's sort accepts only LT/LE/GT/GE comparators: sort one key (lax.sort with num_keys=1, "
  "jnp.argsort) and carry the rest as payload.",
  "custom_call": "neuronx-cc accepts only its own custom calls (NCC_EHCA005): use the pure-XLA path on Neuron "
  "(Pallas, Triton and CPU/GPU kernels have no Neuron lowering) or an NKI kernel.",
  "power": "Use a constant exponent, exp(n * log(x)) for x > 0, or carry the "
  "running product (e.g. beta**t as a state multiplied by beta each step).",
}


@dataclasses.dataclass(frozen=True)
class Violation:
  rule: str  # a key of FIXES
  line: int  # 1-based line of the StableHLO text
  excerpt: str  # the op, shortened
  message: str  # what is wrong and the fix


@dataclasses.dataclass
class Report:
  violations: list
  reduce_windows: collections.Counter  # window_dimensions tuple -> occurrences (reported, not a violation)
  replica_group_sizes: collections.Counter  # devices per replica group -> collectives using it

  def counts(self) -> dict:
    """Violations per rule."""
    return dict(collections.Counter(v.rule for v in self.violations))

  def summary(self, name: str = "program", max_listed: int = 20) -> str:
    """A human-readable report: counts per rule, the first violations, the reported shapes."""
    lines = [
      f"{name}: {len(self.violations)} violation(s)"
      + (" " + ", ".join(f"{r} {n}" for r, n in sorted(self.counts().items())) if self.violations else "")
    ]
    for v in self.violations[:max_listed]:
      lines.append(f"  line {v.line} [{v.rule}] {v.excerpt}\n      {v.message}")
    if len(self.violations) > max_listed:
      lines.append(f"  ... {len(self.violations) - max_listed} more")
    if self.reduce_windows:
      widest = max(self.reduce_windows, key=lambda w: max(w, default=0))
      lines.append(f"  reduce_window shapes: {len(self.reduce_windows)} distinct, widest {list(widest)}")
    if self.replica_group_sizes:
      lines.append(f"  replica-group sizes: {sorted(self.replica_group_sizes)}")
    return "\n".join(lines)


# ---- parsing helpers ----------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TENSOR = re.compile(r"tensor<((?:[0-9?]+x)*)([A-Za-z][\w]*(?:<[^<>]*>)?)")
_DEF = re.compile(r"^\s*(%[^=]*?)\s=\s")
_NAME = re.compile(r"%([\w$.\-]+)")
_CUSTOM_CALL = re.compile(r'stablehlo\.custom_call\s*@([\w.$\-]+)|call_target_name\s*=\s*"([^"]*)"')
_CALL = re.compile(r"\bcall\s+@([\w.$\-]+)")
_FUNC = re.compile(r"func\.func\s+(?:public|private)?\s*@([\w.$\-]+)")
_REPLICA = re.compile(r"replica_groups\s*=\s*dense<[^>]*>\s*:\s*tensor<(\d+)x(\d+)x")
_WINDOW = re.compile(r"window_dimensions\s*=\s*array<i64(?::\s*([0-9, ]*))?>")
_PASS_THROUGH = (
  "stablehlo.broadcast_in_dim",
  "stablehlo.convert",
  "stablehlo.reshape",
  "stablehlo.bitcast_convert",
)


def _strip_attributes(line: str) -> str:
  """The line without strings and without attribute blocks ({...}, <{...}>, dense<...> literals) that open
  and close on it, so what is left holds only values' types and unbalanced region braces."""
  s = _STRING.sub('""', line)
  s = re.sub(r"dense<[^<>]*(?:<[^<>]*>[^<>]*)*>", "dense", s)
  prev = None
  while prev != s:
    prev = s
    s = re.sub(r"\{[^{}]*\}", "", s)
  return s


def _brace_delta(line: str) -> int:
  s = _strip_attributes(line)
  return s.count("{") - s.count("}")


def _region_end(lines: list, start: int) -> int:
  """Index of the line that closes the region(s) opened on lines[start] (depth back to where it began)."""
  depth = 0
  for j in range(start, len(lines)):
    depth += _brace_delta(lines[j])
    if depth <= 0 and j > start:
      return j
  return len(lines) - 1


def _value_types(line: str) -> list:
  """Element types of the values an op line names (its operand, result and block-argument types)."""
  return [t for _, t in _TENSOR.findall(_strip_attributes(line))]


def _signature_types(sig_line: str) -> tuple:
  """(operand types, result types) from an op's trailing `: (a, b) -> (c)` or `: t` signature."""
  s = _strip_attributes(sig_line)
  i = s.rfind(") : ")
  i = s.rfind(" : ") if i < 0 else i + 1
  sig = s[i + 3 :] if i >= 0 else s
  if "->" in sig:
    ins, outs = sig.split("->", 1)
    return [t for _, t in _TENSOR.findall(ins)], [t for _, t in _TENSOR.findall(outs)]
  ts = [t for _, t in _TENSOR.findall(sig)]
  return ts, ts


class _Program:
  """The text's lines with where each SSA name is defined (names repeat across sibling regions, so a use
  refers to the latest definition before it)."""

  def __init__(self, text: str):
    self.lines = text.splitlines()
    self.defs: dict[str, list[int]] = collections.defaultdict(list)
    for i, line in enumerate(self.lines):
      m = _DEF.match(line)
      if m:
        for name in _NAME.findall(m.group(1)):
          self.defs[name].append(i)
      if "stablehlo.while(" in line:  # %iterArg = %init pairs define the loop's block arguments
        for name in re.findall(r"%([\w$.\-]+)\s*=\s*%", line.split("stablehlo.while(", 1)[1]):
          self.defs[name].append(i)
      for name in (
        re.findall(r"%([\w$.\-]+)\s*:\s*tensor<", line)
        if ("^bb" in line or "func.func" in line or ") {" in line)
        else ()
      ):
        self.defs[name].append(i)

  def definition(self, name: str, before: int) -> int | None:
    name = name.lstrip("%").split("#")[0]
    best = None
    for i in self.defs.get(name, ()):
      if i < before or (i == before and "stablehlo.while(" in self.lines[i]):
        best = i
    return best

  def is_constant(self, name: str, at: int, depth: int = 0) -> bool:
    """Whether `name` (used on line `at`) is a compile-time constant: a stablehlo.constant, possibly
    broadcast, converted or reshaped."""
    i = self.definition(name, at)
    if i is None or depth > 12:
      return False
    line = self.lines[i]
    if "stablehlo.constant" in line:
      return True
    for op in _PASS_THROUGH:
      if f"= {op} " in line:
        operands = _NAME.findall(line.split(op, 1)[1])
        return bool(operands) and self.is_constant(operands[0], i, depth + 1)
    return False


def _excerpt(line: str, width: int = 160) -> str:
  s = " ".join(line.split())
  return s if len(s) <= width else s[: width - 1] + "…"


# ---- the rules ----------------------------------------------------------------------------------


def check(text: str) -> Report:
  """Check one program's StableHLO text (`jax.jit(f).lower(...).as_text()`) against the rules above."""
  prog = _Program(text)
  lines = prog.lines
  out: list[Violation] = []
  windows: collections.Counter = collections.Counter()
  groups: collections.Counter = collections.Counter()

  def flag(rule, i, what):
    out.append(Violation(rule, i + 1, _excerpt(lines[i]), f"{what}. {FIXES[rule]}"))

  rbg_exempt = _rbg_state_lines(prog)
  func = ""
  for i, line in enumerate(lines):
    fm = _FUNC.search(line)
    if fm:
      func = fm.group(1)
    cond = re.search(r'"?stablehlo\.(case|if)"?[(\s]', line)
    if cond:
      flag("cond", i, f"stablehlo.{cond.group(1)}")
    if "stablehlo.while(" in line:
      why = _while_not_static(prog, i)
      if why:
        flag("while", i, f"while loop: {why}")
    _check_threefry(prog, i, func, flag)
    bad = sorted({t for t in _value_types(line) if t not in ALLOWED_TYPES})
    if i in rbg_exempt:
      bad = [t for t in bad if t != "ui64"]
    if bad:
      flag("dtype", i, f"element type(s) {', '.join(bad)}")
    for kind in COLLECTIVES:
      if f"stablehlo.{kind}" in line:
        sig = lines[_region_end(lines, i)] if _brace_delta(line) > 0 else line
        ins, _ = _signature_types(sig)
        wrong = sorted({t for t in ins if t not in COLLECTIVE_TYPES})
        if wrong:
          flag("collective", i, f"{kind} of {', '.join(wrong)}")
    g = _REPLICA.search(line)
    if g:
      groups[int(g.group(2))] += 1
    if "stablehlo.reduce(" in line or '"stablehlo.reduce"(' in line:
      why = _variadic_reduce(prog, i)
      if why:
        flag("variadic_reduce", i, why)
    if "stablehlo.sort" in line:
      why = _sort_comparator(prog, i)
      if why:
        flag("sort", i, why)
    cm = _CUSTOM_CALL.search(line)
    if cm:
      target = cm.group(1) or cm.group(2)
      if (
        target not in ALLOWED_CUSTOM_CALLS and not target.startswith("AwsNeuron") and "threefry" not in target
      ):
        flag("custom_call", i, f"custom call @{target}")
    if "stablehlo.power " in line:
      operands = _NAME.findall(line.split("stablehlo.power", 1)[1].split(":")[0])
      if len(operands) >= 2 and not prog.is_constant(operands[1], i):
        flag("power", i, "power's exponent is a runtime value")
    if "reduce_window" in line:
      w = _WINDOW.search(line)
      if w:
        windows[tuple(int(x) for x in (w.group(1) or "").replace(" ", "").split(",") if x)] += 1
  return Report(out, windows, groups)


def violations(text: str) -> list:
  """Just the violations of `check(text)`."""
  return check(text).violations


def _rbg_state_lines(prog: _Program) -> set:
  """Lines whose ui64 is rng_bit_generator's state: the generator and the bitcasts into and out of it."""
  exempt = set()
  for i, line in enumerate(prog.lines):
    if "stablehlo.rng_bit_generator" not in line:
      continue
    exempt.add(i)
    m = _DEF.match(line)
    state_out = _NAME.findall(m.group(1))[0] if m else None
    operand = _NAME.findall(line.split("stablehlo.rng_bit_generator", 1)[1])
    if operand:
      d = prog.definition(operand[0], i)
      if d is not None and "bitcast_convert" in prog.lines[d]:
        exempt.add(d)
    if state_out:
      for j in range(i + 1, min(len(prog.lines), i + 40)):
        if "bitcast_convert" in prog.lines[j] and re.search(rf"%{re.escape(state_out)}\b", prog.lines[j]):
          exempt.add(j)
  return exempt


def _check_threefry(prog: _Program, i: int, func: str, flag):
  line = prog.lines[i]
  cm = _CUSTOM_CALL.search(line)
  if cm and "threefry" in (cm.group(1) or cm.group(2)).lower():
    flag("threefry", i, "Threefry custom call")
    return
  call = _CALL.search(line)
  if call and "threefry" in call.group(1).lower() and "func.func" not in line:
    flag("threefry", i, f"call to @{call.group(1)}")
    return
  if THREEFRY_PARITY in line and "threefry" not in func.lower() and "stablehlo.constant" in line:
    flag("threefry", i, "Threefry's key-schedule constant 0x1BD11BDA (an inlined Threefry hash)")


def _while_not_static(prog: _Program, i: int) -> str | None:
  """Why the while loop on line i has no constant trip count (None when it has one): its condition must
  compare a loop counter against a constant, the counter start at a constant and step by one."""
  lines = prog.lines
  header = lines[i].split("stablehlo.while(", 1)[1]
  pairs = re.findall(r"%([\w$.\-]+)\s*=\s*(%[\w$.\-#]+)", header.split(")", 1)[0])
  names = [p[0] for p in pairs]
  # Regions: `cond {` ... `} do {` ... `}`.
  cond_lines: list[int] = []
  body_lines: list[int] = []
  part: list[int] | None = None
  j, depth = i + 1, 0
  while j < len(lines):
    s = lines[j].strip()
    if depth == 0 and s.startswith("cond {"):
      part, depth = cond_lines, 1
    elif depth == 1 and s.startswith("} do {"):
      part = body_lines
    else:
      depth += _brace_delta(lines[j])
      if depth == 0:
        break
      if part is None:
        raise ValueError(f"while loop on line {i + 1}: a region opens before its `cond {{` block")
      part.append(j)
    j += 1
  ret = next((k for k in reversed(cond_lines) if "stablehlo.return" in lines[k]), None)
  if ret is None:
    return "its condition could not be read"
  cond_val = _NAME.findall(lines[ret].split("stablehlo.return", 1)[1])[0]
  d = prog.definition(cond_val, ret)
  m = (
    re.search(r"stablehlo\.compare\s+(\w+),\s*(%[\w$.\-#]+),\s*(%[\w$.\-#]+)", lines[d])
    if d is not None
    else None
  )
  if d is None or not m:
    return "its condition is not a comparison of a counter with a bound"
  _, a, b = m.groups()
  a, b = a.lstrip("%"), b.lstrip("%")

  def bound_constant(x):
    if prog.is_constant(x, d):
      return True
    if x in names:  # a bound carried through the loop unchanged, starting from a constant
      k = names.index(x)
      return prog.is_constant(pairs[k][1], i) and _returned(prog, body_lines, k) == x
    return False

  for counter, bound in ((a, b), (b, a)):
    if counter in names and bound_constant(bound):
      k = names.index(counter)
      if not prog.is_constant(pairs[k][1], i):
        return f"the counter %{counter} starts at a runtime value"
      nxt = _returned(prog, body_lines, k)
      dn = prog.definition(nxt, body_lines[-1] + 1) if nxt else None
      step = (
        re.search(r"stablehlo\.(?:add|subtract)\s+(%[\w$.\-#]+),\s*(%[\w$.\-#]+)", lines[dn])
        if dn is not None
        else None
      )
      if dn is None or step is None:
        return f"the counter %{counter} does not step by a constant"
      ops = [o.lstrip("%").split("#")[0] for o in step.groups()]
      if counter not in ops or not any(prog.is_constant(o, dn) for o in ops if o != counter):
        return f"the counter %{counter} does not step by a constant"
      return None
  return f"the bound of `{_excerpt(lines[d], 80)}` is not a constant"


def _returned(prog: _Program, body_lines: list, k: int) -> str | None:
  """The name the loop body returns at position k."""
  for j in reversed(body_lines):
    line = prog.lines[j]
    if "stablehlo.return" in line:
      vals = _NAME.findall(line.split("stablehlo.return", 1)[1].split(":")[0])
      return vals[k].split("#")[0] if k < len(vals) else None
  return None


def _variadic_reduce(prog: _Program, i: int) -> str | None:
  """Why the reduce on line i is a forbidden variadic one (None: one operand, or argmax's pair)."""
  lines = prog.lines
  line = lines[i]
  if "init:" in line:
    n = line.count("init:")
    ins, _ = _signature_types(line)
  else:  # generic form: operands then as many inits
    sig = lines[_region_end(lines, i)] if _brace_delta(line) > 0 else line
    ins, _ = _signature_types(sig)
    n = len(ins) // 2
  if n <= 1:
    return None
  start = i + 1 if i + 1 < len(lines) and "reducer(" in lines[i + 1] else i  # pretty form: `reducer(...) {`
  end = _region_end(lines, start) if _brace_delta(lines[start]) > 0 else i
  body = "\n".join(lines[i + 1 : end + 1])
  if (
    n == 2
    and ins[1] in ("i32", "ui32")
    and _is_iota(prog, line, i)
    and "stablehlo.select" in body
    and "stablehlo.compare" in body
  ):
    return None  # argmax / argmin: (value, iota index), a compare-and-select reducer
  return f"reduce over {n} operands ({', '.join(ins[:n])})"


def _is_iota(prog: _Program, line: str, i: int) -> bool:
  """Whether the reduce's second operand is an iota (the index of argmax's pair)."""
  operands = re.findall(r"\(\s*(%[\w$.\-#]+)\s+init:", line)
  if len(operands) < 2:
    operands = _NAME.findall(line.split("reduce", 1)[1].split(")", 1)[0])[:2]
  d = prog.definition(operands[1], i) if len(operands) >= 2 else None
  return d is not None and "stablehlo.iota" in prog.lines[d]


def _sort_comparator(prog: _Program, i: int) -> str | None:
  lines = prog.lines
  end = _region_end(lines, i)
  ret = next((k for k in range(end, i, -1) if "stablehlo.return" in lines[k]), None)
  if ret is None:
    return "its comparator could not be read"
  val = _NAME.findall(lines[ret].split("stablehlo.return", 1)[1])[0]
  d = prog.definition(val, ret)
  m = re.search(r"stablehlo\.compare\s+(\w+),", lines[d] if d is not None else "")
  if not m:
    return "its comparator combines several comparisons (more than one key)"
  if m.group(1) not in SORT_DIRECTIONS:
    return f"its comparator compares {m.group(1)}"
  return None


def check_programs(texts: dict, hlo_dir: str | None = None) -> tuple[dict, str]:
  """Check several programs' StableHLO ({name: text}); with `hlo_dir`, write each to hlo_dir/<name>.mlir.
  Returns ({name: Report}, the printable report of all of them)."""
  if hlo_dir:
    pathlib.Path(hlo_dir).mkdir(parents=True, exist_ok=True)
  reports, parts = {}, []
  for name, text in texts.items():
    if hlo_dir:
      (pathlib.Path(hlo_dir) / f"{name}.mlir").write_text(text)
    reports[name] = check(text)
    parts.append(reports[name].summary(name))
  total = sum(len(r.violations) for r in reports.values())
  parts.append(
    f"neuron conformance: {total} violation(s) in {len(reports)} program(s)"
    + (f"; StableHLO in {hlo_dir}/" if hlo_dir else "")
  )
  return reports, "\n".join(parts)
