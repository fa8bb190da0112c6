"""What a resumed run may change: the whole run config is saved with each checkpoint and compared on resume.

Fields that only say how long, how often, where and on what a run executes (ALLOWED) may differ; any other
difference refuses the resume with a list of the differences and the `--allow_changes` flag that accepts
them. The LR schedule's length is part of the run: an extended run keeps the saved schedule unless the user
set `optimizer.total_steps` (or `warmup_steps`) and allows the change.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from laplace_jax.training.train_state import TrainState
from train.run_config import SECTIONS, RunConfig

# How long, how often, where to and on what a run executes. tokens_per_step is only a way to set global_batch,
# which is compared.
_TRAIN_ALLOWED = (
  "out_dir",
  "steps",
  "tokens_per_step",
  "mesh_data",
  "mesh_fsdp",
  "mesh_context",
  "simulate_devices",
  "log_every",
  "eval_every",
  "eval_batches",
  "eval_batch",
  "save_every",
  "keep_checkpoints",
  "resume",
  "max_bad_steps",
  "compile_only",
  "coordinator",
  "num_processes",
  "process_id",
  "sample_tokens",
  "sample_prompt",
  "progress",
  "verbose",
  "allow_changes",
  "profile_steps",
  "prng",
)  # the flag's spelling may change ("auto" → "rbg"); check_prng compares the impl used
# Execution choices of the model that leave its math unchanged (remat, the GLA form and its unrolling, the
# layer stack scanned or unrolled).
_MODEL_ALLOWED = ("remat", "unroll_chunks", "gla_form", "scan_layers")
ALLOWED = frozenset([f"train.{f}" for f in _TRAIN_ALLOWED] + [f"model.{f}" for f in _MODEL_ALLOWED])
SCHEDULE = ("optimizer.total_steps", "optimizer.warmup_steps")  # derived from --steps unless set
# Fields whose runs saved before they existed ran otherwise than their default says: such a run resumes with
# the value it had (unless the flag is given, which is then a change like any other).
BEFORE_IT_EXISTED = {"train.segment_ids": False}


def run_config_dict(rc: RunConfig) -> dict:
  """The run config as saved with each checkpoint: {"train": {...}, "model": {...}, "optimizer": {...}}."""
  return json.loads(json.dumps({s: dataclasses.asdict(getattr(rc, s)) for s in SECTIONS}))


def checkpoint_metadata(rc: RunConfig, prng_impl: str) -> dict:
  """What each checkpoint saves beside the state: the model config once, under "config" (which
  laplace_jax.training.checkpoint checks on restore), the run config's other sections under "run_config", the PRNG."""
  run = run_config_dict(rc)
  return {"config": run.pop("model"), "run_config": run, "prng_impl": prng_impl}


def saved_run_config(meta: dict) -> dict:
  """`run_config_dict` of a checkpoint's run, read from its metadata: the model from "config". Checkpoints that
  also held it under run_config["model"] read the same, and those without a run config give {"model": ...}."""
  run = meta.get("run_config") or {}
  merged = {**run, "model": meta.get("config") or run.get("model") or {}}
  return {s: merged[s] for s in SECTIONS if s in merged}


def _flag(key: str) -> str:
  section, name = key.split(".", 1)
  return f"--{name}" if section == "train" else f"--{key}"


def _allowed_changes(rc: RunConfig) -> frozenset:
  names = frozenset(n.strip() for n in rc.train.allow_changes.split(",") if n.strip())
  valid = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
  unknown = sorted(names - valid)
  if unknown:
    raise ValueError(
      f"--allow_changes {rc.train.allow_changes!r}: unknown field(s) {unknown}; expected "
      "section.field names such as optimizer.muon_lr or train.global_batch."
    )
  return names


def reconcile(rc: RunConfig, saved: dict, *, where: str) -> tuple[RunConfig, list[str]]:
  """The config to resume with, and notes for the log; raises ValueError on a difference not allowed.

  `saved` is `run_config_dict` of the checkpoint's run, or {"model": {...}} for a checkpoint that saved only
  the model config (then only the model is compared). Schedule fields the user did not set take the saved
  values, so a run extended with a larger --steps keeps its learning-rate schedule."""
  allowed = _allowed_changes(rc)
  notes = []
  opt_saved = saved.get("optimizer")
  if opt_saved is not None:
    keep = {
      k.split(".", 1)[1]: opt_saved[k.split(".", 1)[1]]
      for k in SCHEDULE
      if k not in rc.explicit and k.split(".", 1)[1] in opt_saved
    }
    changed = {k: v for k, v in keep.items() if getattr(rc.optimizer, k) != v}
    if changed:
      rc = dataclasses.replace(rc, optimizer=rc.optimizer.replace(**changed))
      notes.append(
        "kept the run's LR schedule ("
        + ", ".join(f"{k} {v}" for k, v in changed.items())
        + "); a new one needs --optimizer.total_steps N --allow_changes optimizer.total_steps"
      )
  for key, old in BEFORE_IT_EXISTED.items():
    section, name = key.split(".")
    if section in saved and name not in saved[section] and key not in rc.explicit:
      if getattr(getattr(rc, section), name) != old:
        rc = dataclasses.replace(rc, **{section: dataclasses.replace(getattr(rc, section), **{name: old})})
        notes.append(
          f"kept {key}={old!r}: the run was saved before the option existed (set --{name} "
          f"--allow_changes {key} to change it)"
        )
  now = run_config_dict(rc)
  diffs = []
  for section, values in saved.items():
    if section not in now:
      continue
    # A field newer than the checkpoint counts as saved with its default (what the run used), or with the
    # value runs had before it existed.
    defaults = {f.name: f.default for f in dataclasses.fields(SECTIONS[section])}
    defaults |= {k.split(".")[1]: v for k, v in BEFORE_IT_EXISTED.items() if k.split(".")[0] == section}
    for name in sorted(set(values) | set(now[section])):
      key = f"{section}.{name}"
      old = values.get(name, json.loads(json.dumps(defaults.get(name, "<absent>"))))
      new = now[section].get(name, "<absent>")
      if old == new or key in ALLOWED:
        continue
      if key in allowed:
        notes.append(f"{key} changed from {old!r} to {new!r} (allowed by --allow_changes)")
      else:
        diffs.append((key, old, new))
  if diffs:
    lines = "\n".join(f"  {k}: saved {o!r}, now {n!r} ({_flag(k)})" for k, o, n in diffs)
    raise ValueError(
      f"refusing to resume {where}: this run's config differs from the one it was saved with\n{lines}\n"
      "Resume with the saved values (drop those settings), start a new run in another --out_dir, or accept "
      f"the changes with --allow_changes {','.join(k for k, _, _ in diffs)}"
    )
  return rc, notes


def check_prng(impl: str, meta: dict, *, where: str) -> None:
  """Refuse to resume a run whose checkpoint was made under another PRNG implementation: its initialisation
  and its saved key (2 words under threefry, 4 under rbg) belong to that implementation. Checkpoints from
  before the choice existed were made under JAX's default, threefry."""
  saved = meta.get("prng_impl", "threefry")
  if saved != impl:
    raise ValueError(
      f"refusing to resume {where}: that run used the {saved!r} PRNG, this one would use "
      f"{impl!r}. Resume with --prng {saved} (the choice cannot be changed mid-run), or start a new "
      "run in another --out_dir."
    )


def drop_rows_after(metrics_path: Path, step: int) -> int:
  """Removes metrics rows of steps after `step` (written before a crash, about to be redone) and any torn
  row; returns how many went. The file is replaced atomically."""
  if not metrics_path.exists():
    return 0

  def step_of(line):
    try:
      return json.loads(line).get("step", 0)
    except json.JSONDecodeError:  # a row cut short by the kill
      return step + 1

  lines = [l for l in metrics_path.read_text().splitlines() if l.strip()]
  keep = [l for l in lines if step_of(l) <= step]
  if len(keep) != len(lines):
    tmp = metrics_path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(l + "\n" for l in keep))
    tmp.replace(metrics_path)
  return len(lines) - len(keep)


def restore_train_state(ckpt, abstract: TrainState):
  """(ckpt.restore onto `abstract`, its train_state a TrainState; a note or None). The checkpoint holds the
  state's to_tree(). A state-passing checkpoint saved before the carry gained `pos` (the conv window became
  a ring, commit 32107bb) is restored with pos = 0, which is exact: the old window held the last conv_size
  inputs oldest first, and a ring read at pos ≡ 0 (mod conv_size) holds them in that same order (slot s:
  position pos − conv_size + s); nothing else in a training carry reads pos (attention layers carry no cache
  and start each segment at position 0)."""
  restored, note = _restore_tree(ckpt, abstract.to_tree())
  return dataclasses.replace(restored, train_state=TrainState.from_tree(restored.train_state)), note


def _restore_tree(ckpt, abstract: dict):
  carry = abstract.get("carry")
  if carry is None or "pos" not in carry:
    return ckpt.restore(abstract_state=abstract), None
  # Decided per step tried: the newest step may be damaged and the restore fall back to an older one.
  without_pos = {**abstract, "carry": {k: v for k, v in carry.items() if k != "pos"}}
  restored = ckpt.restore(abstract_state=lambda names: abstract if "carry.pos" in names else without_pos)
  if "pos" in restored.train_state["carry"]:
    return restored, None
  pos = carry["pos"]
  zeros = np.zeros(pos.shape, pos.dtype)
  pos = (
    jax.make_array_from_callback(pos.shape, pos.sharding, lambda idx: zeros[idx])
    if getattr(pos, "sharding", None) is not None
    else zeros
  )
  state = {**restored.train_state, "carry": {**restored.train_state["carry"], "pos": pos}}
  return dataclasses.replace(restored, train_state=state), (
    f"resume: step {restored.step}'s carry predates carry.pos (conv windows stored oldest first); "
    "restored with pos = 0, which reads them in that order"
  )
