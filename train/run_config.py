"""The training program's one config system: preset → TOML file → command-line flags, later wins.

A TOML file has up to three tables, each mirroring a dataclass: [train] (TrainConfig below), [model]
(laplace_jax.model.config.LaplaceConfig) and [optimizer] (laplace_jax.training.optimizer.OptimizerConfig). On the command
line, train fields are `--steps 100`, model and optimizer fields `--model.d_model 128`,
`--optimizer.adamw_lr 3e-3`. Every field is a flag and `--help` lists them all with their defaults; a flag's
help is its field's docstring, written once beside the field. Flags are spelled with underscores, as the
fields are; the dashed spelling (`--data-dir`, `--model.d-model`, `--no-resume`) is accepted too.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

import tomllib

from laplace_jax import cli
from laplace_jax.data.recall_tasks import parse_task
from laplace_jax.model.config import PRESETS, LaplaceConfig, get_config
from laplace_jax.platform import PRNG_CHOICES
from laplace_jax.training.optimizer import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  preset: str = "tiny"
  """model preset"""
  data_dir: str = "data/kjv"
  """prepared data (python -m train.prepare); prepared from the embedded corpus if missing and it is the
  default"""
  data_source: str = ""
  """training data: '' (text prepared in data_dir) or a recall task generated on the fly, mqar:SEQ,PAIRS (e.g.
  mqar:64,4) | passkey:SEQ (set --seq_len to SEQ)"""
  out_dir: str = "runs/tiny"
  """run directory: checkpoints/, metrics.jsonl, loss.png, export/"""
  steps: int = 200
  """total optimizer steps of the run (a resumed run continues to this number)"""
  global_batch: int = 16
  """sequences per optimizer step, over all devices and micro-batches"""
  seq_len: int = 0
  """tokens per sequence (0: the model's max_seq_len)"""
  tokens_per_step: int = 0
  """sets global_batch to this many tokens / seq_len (0: use global_batch): keeps the tokens per step when the
  sequence length changes"""
  micro_batches: int = 1
  """split each step into this many accumulated micro-batches (memory)"""
  z_loss: float = 1e-4
  """weight of the z-loss logsumexp² term (0 disables it)"""
  mesh_data: int = 1
  """data-parallel axis size of the device mesh"""
  mesh_fsdp: int = 0
  """FSDP axis size (0: all devices left after mesh_data and mesh_context)"""
  mesh_context: int = 1
  """context-parallel axis size: each row's sequence split over this many devices (G and S layers; seq_len a
  multiple of it)"""
  simulate_devices: int = 0
  """CPU only: simulate this many devices (XLA host device count); 0 keeps the real ones"""
  seed: int = 0
  """seed of the initialisation and of the data order"""
  prng: str = "auto"
  """JAX's PRNG implementation: auto (rbg on Neuron and with --target neuron, threefry elsewhere) | threefry |
  rbg | unsafe_rbg; the same seed initialises differently under each, and a resumed run must use its
  checkpoint's"""
  log_every: int = 10
  """write metrics every N steps"""
  eval_every: int = 50
  """held-out eval loss every N steps (0: only at the end)"""
  eval_batches: int = 4
  """held-out batches per eval (0: no held-out loss)"""
  eval_batch: int = 0
  """sequences per held-out batch, a multiple of the devices the batch is split over (0: global_batch)"""
  save_every: int = 100
  """checkpoint every N steps (the last step is always saved)"""
  keep_checkpoints: int = 3
  """keep the newest N checkpoints"""
  resume: bool = True
  """resume from the newest checkpoint in out_dir when one exists (--no_resume starts afresh, which needs an
  empty checkpoint directory)"""
  init_from: str = ""
  """start from the params of an export (RUN/export/step_N, or a directory `python -m train.import_hf`
  wrote) instead of a random init, with a fresh optimizer: fine-tuning. Its model config must equal this
  run's (checked before the compile); a run that resumes takes its checkpoint's params instead"""
  max_bad_steps: int = 10
  """stop after this many consecutive non-finite steps"""
  compile_only: bool = False
  """lower and compile the step from abstract shapes, print memory and time, then exit"""
  target: str = ""
  """lower (never compile) the step from abstract shapes with the choices made on this platform ('neuron':
  Trainium), print the conformance report (laplace_jax.analysis.neuron_check), exit 1 on a violation; simulates 64
  devices (a trn2.48xlarge) unless --simulate_devices says otherwise"""
  hlo_dir: str = ""
  """with --target: write the step's StableHLO to DIR/train_step.mlir"""
  coordinator: str = ""
  """multi-process: coordinator address host:port (or JAX_COORDINATOR_ADDRESS)"""
  num_processes: int = 1
  """multi-process: process count (or JAX_NUM_PROCESSES)"""
  process_id: int = 0
  """multi-process: this process's id (or JAX_PROCESS_ID)"""
  sample_tokens: int = 0
  """after training, print this many tokens sampled from the final params (0: none)"""
  sample_prompt: str = "In the beginning"
  """prompt for the sample"""
  progress: bool = True
  """show a progress bar"""
  verbose: bool = False
  """show the INFO lines of the libraries underneath (JAX's platform probe, grain, Orbax); off: their
  warnings and errors only"""
  allow_changes: str = ""
  """resume even though these config fields differ from the checkpoint's (comma-separated, e.g.
  optimizer.muon_lr,optimizer.total_steps; a new total_steps is a new LR schedule)"""
  profile_steps: int = 0
  """capture a jax.profiler trace of this many steps (after the first, which compiles) into out_dir/profile,
  viewable in TensorBoard or Perfetto (0: none)"""
  state_passing: bool = False
  """state passing (truncated BPTT): each batch row is one contiguous token stream that continues across
  steps, and each step starts the row from its recurrent state at the end of the previous step (GLA states
  and conv windows; no gradient across the boundary)"""
  segment_ids: bool = True
  """packed documents apart: each document of a row computed as if alone (the GLA state, conv window and
  attention restart where the next begins; segment ids from the data pipeline, text data only); off (e.g.
  --no_segment_ids): a row is one stream, read across its documents. A run saved before the option keeps
  it off"""

  def __post_init__(self):
    for f in (
      "steps",
      "global_batch",
      "micro_batches",
      "mesh_data",
      "mesh_context",
      "log_every",
      "keep_checkpoints",
      "max_bad_steps",
      "num_processes",
      "save_every",
    ):
      if getattr(self, f) < 1:
        raise ValueError(f"--{f}={getattr(self, f)}: expected a positive integer.")
    for f in (
      "seq_len",
      "tokens_per_step",
      "mesh_fsdp",
      "simulate_devices",
      "eval_every",
      "eval_batches",
      "eval_batch",
      "sample_tokens",
      "process_id",
      "profile_steps",
    ):
      if getattr(self, f) < 0:
        raise ValueError(f"--{f}={getattr(self, f)}: expected an integer >= 0.")
    if self.data_source:
      parse_task(self.data_source)
    if self.prng not in PRNG_CHOICES:
      raise ValueError(
        f"--prng={self.prng!r}: expected one of {PRNG_CHOICES} (auto: rbg on Neuron, threefry elsewhere)."
      )
    if self.target not in ("", "neuron"):
      raise ValueError(
        f"--target={self.target!r}: the only lowering target is 'neuron' (Trainium); on a CPU or "
        "GPU host run without --target (--compile_only compiles for the host)."
      )
    if self.hlo_dir and not self.target:
      raise ValueError(
        f"--hlo_dir={self.hlo_dir!r} needs --target neuron (it is where the lowered step goes)."
      )
    if self.target and self.compile_only:
      raise ValueError("--target lowers without compiling; drop --compile_only (or --target).")
    if self.preset not in PRESETS:
      raise ValueError(f"--preset={self.preset!r}: expected one of {sorted(PRESETS)}.")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  train: TrainConfig
  model: LaplaceConfig
  optimizer: OptimizerConfig
  explicit: frozenset = frozenset()  # "section.field" names set by the TOML file or a flag (not defaults)


SECTIONS = {"train": TrainConfig, "model": LaplaceConfig, "optimizer": OptimizerConfig}


def _parse_bool(s: str) -> bool:
  if s.lower() in ("1", "true", "yes", "on"):
    return True
  if s.lower() in ("0", "false", "no", "off"):
    return False
  raise argparse.ArgumentTypeError(f"{s!r} is not a boolean (use true/false)")


def _field_type(cls, f):
  t = typing.get_type_hints(cls)[f.name]
  origin = typing.get_args(t)
  return t if not origin else next(a for a in origin if a is not type(None))


def _shown_default(section: str, name: str, preset: str, plain):
  """The default a flag's help shows: the train field's own, or the chosen preset's model or optimizer
  value (the optimizer's schedule spans the run's --steps in every preset but laplace-3b)."""
  if section == "model":
    return getattr(get_config(preset), name)
  if section == "optimizer":
    if preset != "laplace-3b" and name in ("total_steps", "warmup_steps"):
      return "--steps" if name == "total_steps" else "max(1, --steps // 20)"
    return getattr(optimizer_defaults(preset, TrainConfig.steps), name)
  return plain


def build_parser(preset: str = TrainConfig.preset) -> argparse.ArgumentParser:
  """Every field of the three sections is a flag; its help is the field's docstring (laplace_jax.cli) and
  the default the run will use: [model] and [optimizer] defaults are `preset`'s."""
  ap = cli.FlagParser(
    prog="python -m train",
    description="Train a Laplace model with pjit over a device mesh.",
    epilog=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--config", metavar="FILE.toml", help="TOML file with [train], [model], [optimizer] tables")
  for section, cls in SECTIONS.items():
    title = f"[{section}]"
    if section != "train":
      title += f" (defaults: --preset {preset}'s; `--preset NAME --help` shows another preset's)"
    group = ap.add_argument_group(title)
    for f in dataclasses.fields(cls):
      flag = f"--{f.name}" if section == "train" else f"--{section}.{f.name}"
      t = _field_type(cls, f)
      default = _shown_default(section, f.name, preset, f.default)
      helptext = cli.field_help(cls, f.name) + (f": one of {sorted(PRESETS)}" if f.name == "preset" else "")
      if t is bool and section == "train":
        group.add_argument(
          flag,
          dest=f"{section}.{f.name}",
          action=cli.Toggle,
          default=None,
          help=f"{helptext} (default: {default})",
        )
      else:
        typ = _parse_bool if t is bool else (t if t in (int, float, str) else str)
        shown = default if isinstance(default, str) and default.startswith(("--", "max(")) else repr(default)
        group.add_argument(
          flag,
          dest=f"{section}.{f.name}",
          type=typ,
          default=None,
          metavar=t.__name__.upper() if hasattr(t, "__name__") else "V",
          help=f"{helptext} (default: {shown})".strip(),
        )
  return ap


def chosen_preset(argv: list[str]) -> str:
  """The preset a command line picks (--preset, else its --config's [train] preset, else the default), read
  before the full parse so that --help can show that preset's defaults; anything unreadable is left to it."""
  pre = cli.FlagParser(add_help=False)
  pre.add_argument("--preset")
  pre.add_argument("--config")
  known, _ = pre.parse_known_args(argv)
  preset = known.preset
  if preset is None and known.config:
    try:
      with open(known.config, "rb") as fh:
        preset = tomllib.load(fh).get("train", {}).get("preset")
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
      preset = None
  return preset if preset in PRESETS else TrainConfig.preset


def _apply(cls, base, values: dict, where: str):
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = set(values) - names
  if unknown:
    raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; valid: {sorted(names)}")
  return dataclasses.replace(base, **values) if values else base


def optimizer_defaults(preset: str, steps: int) -> OptimizerConfig:
  """laplace-3b: the published schedule (3,815 warm-up steps of 190,735). Smaller presets: the schedule
  spans the run (5% warm-up) and AdamW (embeddings, head) runs hotter, as small models tolerate."""
  if preset == "laplace-3b":
    return OptimizerConfig()
  return OptimizerConfig(total_steps=steps, warmup_steps=max(1, steps // 20), adamw_lr=3e-3)


def _type_errors(cls, values: dict, table: str) -> list[str]:
  """One line per value of a TOML table whose type is not its field's (an int is a valid float)."""
  errors = []
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for name, value in values.items():
    if name not in fields:
      continue  # unknown names: _apply's error lists the valid ones
    t = _field_type(cls, fields[name])
    if t not in (int, float, str, bool):
      continue
    ok = isinstance(value, t) and (t is bool or not isinstance(value, bool))
    if t is float and isinstance(value, int) and not isinstance(value, bool):
      ok = True
    if not ok:
      want = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[t]
      errors.append(f"[{table}] {name} = {value!r}: expected {want}")
  return errors


def read_toml(path: str) -> dict:
  try:
    with open(path, "rb") as fh:
      data = tomllib.load(fh)
  except FileNotFoundError:
    raise ValueError(f"--config {path}: no such file.") from None
  except tomllib.TOMLDecodeError as e:
    raise ValueError(f"--config {path}: not valid TOML ({e}).") from None
  unknown = set(data) - set(SECTIONS)
  if unknown:
    raise ValueError(f"--config {path}: unknown table(s) {sorted(unknown)}; expected {sorted(SECTIONS)}.")
  errors = [e for sec, cls in SECTIONS.items() for e in _type_errors(cls, data.get(sec, {}), sec)]
  if errors:
    raise ValueError(
      f"--config {path}: {len(errors)} value(s) of the wrong type (TOML strings are quoted, numbers "
      "and true/false are not):\n  " + "\n  ".join(errors)
    )
  return data


def load_config(argv=None) -> RunConfig:
  """Parse flags (and the TOML file they name) into a validated RunConfig: preset → TOML → flags."""
  argv = sys.argv[1:] if argv is None else list(argv)
  args = vars(build_parser(chosen_preset(argv)).parse_args(argv))
  toml = read_toml(args.pop("config")) if args.get("config") else {}
  args.pop("config", None)
  flags = {
    sec: {k.split(".", 1)[1]: v for k, v in args.items() if k.startswith(sec + ".") and v is not None}
    for sec in SECTIONS
  }
  train_vals = {**toml.get("train", {}), **flags["train"]}
  train = _apply(TrainConfig, TrainConfig(), train_vals, "[train]")
  model = _apply(
    LaplaceConfig, get_config(train.preset), {**toml.get("model", {}), **flags["model"]}, "[model]"
  )
  optimizer = _apply(
    OptimizerConfig,
    optimizer_defaults(train.preset, train.steps),
    {**toml.get("optimizer", {}), **flags["optimizer"]},
    "[optimizer]",
  )
  if train.tokens_per_step:
    seq = train.seq_len or model.max_seq_len
    if train.tokens_per_step % seq:
      raise ValueError(
        f"--tokens_per_step={train.tokens_per_step}: expected a multiple of the sequence length "
        f"{seq}. Use e.g. {max(1, train.tokens_per_step // seq) * seq}."
      )
    if "global_batch" in train_vals and train_vals["global_batch"] * seq != train.tokens_per_step:
      raise ValueError(
        f"--global_batch={train.global_batch} and --tokens_per_step={train.tokens_per_step} "
        f"disagree at seq_len {seq}; set only one of them."
      )
    train = dataclasses.replace(train, global_batch=train.tokens_per_step // seq)
  explicit = frozenset(f"{sec}.{k}" for sec in SECTIONS for k in {**toml.get(sec, {}), **flags[sec]})
  return RunConfig(train, model, optimizer, explicit)
