"""Orbax checkpoints of any training-state pytree, the data iterator's position and the run's metadata.

On disk, one Orbax CheckpointManager directory (every item readable with plain Orbax calls):

    <directory>/<step>/
      train_state/                   ocp.args.StandardSave of the pytree (params, opt_state, step, rng)
      data_state/process_<i>-of-<n>.json   grain's own iterator-checkpoint format, one file per process
      meta/metadata                  JSON: the caller's metadata (incl. "config") + "data_state_kind"
    <directory>/<step>.orbax-checkpoint-tmp*/   a save in flight or cut short; never counted as a step
    <directory>/<step>.corrupt/      a damaged step that restore(step=None) skipped, kept for inspection

Orbax writes each step under a temporary name and renames it when complete, so a crash or a full disk
mid-save leaves the previous steps intact; old steps are deleted only after a newer one is finalised.

A params-only export for serving is a separate directory: `<path>/params/` (StandardSave) and
`<path>/config/metadata` (JSON).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from grain import checkpoint as grain_ckpt

from laplace_jax import model
from laplace_jax.model.config import LAYOUT_NEUTRAL, LaplaceConfig, get_config

log = logging.getLogger(__name__)

TRAIN_STATE, DATA_STATE, META = "train_state", "data_state", "meta"
_KIND_KEY = "data_state_kind"  # reserved metadata key: how to decode the data state ("dict" | "bytes")
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


class CorruptCheckpointError(ValueError):
  """A finalised checkpoint step whose files are missing or unreadable."""


class CheckpointSaveError(RuntimeError):
  """A save that failed (e.g. a full disk); the previous checkpoints are untouched."""


@dataclasses.dataclass(frozen=True)
class Restored:
  """What `Checkpointer.restore` returns."""

  step: int
  train_state: Any
  data_state: Any  # dict or bytes as saved, or None
  metadata: dict


class Checkpointer:
  """Asynchronous, keep-last-N Orbax checkpoints of (train_state, data_state, metadata) by step.

  Use as a context manager, or call `close()`: it waits for the last save.
  """

  def __init__(
    self, directory, *, max_to_keep: int | None = 3, save_interval_steps: int = 1, async_save: bool = True
  ):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(
        f"max_to_keep={max_to_keep!r}: expected an integer >= 1 or None (keep all). "
        "Keep at least the newest checkpoint."
      )
    if save_interval_steps < 1:
      raise ValueError(
        f"save_interval_steps={save_interval_steps!r}: expected an integer >= 1. "
        "Use 1 to allow a save at every step."
      )
    self.directory = epath.Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      save_interval_steps=save_interval_steps,
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
      create=True,
    )
    self._mgr = ocp.CheckpointManager(
      self.directory,
      options=options,
      item_handlers={
        TRAIN_STATE: ocp.StandardCheckpointHandler(),
        DATA_STATE: grain_ckpt.CheckpointHandler(),
        META: ocp.JsonCheckpointHandler(),
      },
    )
    self._in_flight: int | None = None  # the step whose async save is not yet known to be complete
    self._barriers = 0

  # -- saving ------------------------------------------------------------------------------------

  def save(
    self, step: int, train_state, data_state=None, metadata: dict | None = None, *, force: bool = False
  ) -> bool:
    """Starts an async save of `step` if the interval says so (or `force`); returns whether it did.

    The arrays are copied to host before this returns, so the caller may donate them right away.
    Every process calls this; `data_state` is this process's iterator state (saved per process).
    """
    step = _check_step(step)
    meta = _meta_json(metadata, data_state)
    skip = step in self._mgr.all_steps() if force else not self._mgr.should_save(step)
    if skip:
      return False  # off-interval, or (a forced final save) that step is already on disk
    self.wait_until_finished()  # surfaces a failure of the previous save under its own step
    items = {TRAIN_STATE: ocp.args.StandardSave(train_state), META: ocp.args.JsonSave(meta)}
    if data_state is not None:
      items[DATA_STATE] = grain_ckpt.CheckpointSave(_DataStateBox(data_state))
    try:
      saved = self._mgr.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as e:
      raise self._save_failed(step, e) from e
    self._in_flight = step if saved else None
    return saved

  def wait_until_finished(self):
    """Blocks until the pending save is on disk; raises CheckpointSaveError if it failed."""
    try:
      self._mgr.wait_until_finished()
    except Exception as e:
      raise self._save_failed(self._in_flight, e) from e
    self._in_flight = None

  def close(self):
    """Waits for the pending save, then releases Orbax's threads."""
    try:
      self.wait_until_finished()
    finally:
      self._mgr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _save_failed(self, step, error) -> CheckpointSaveError:
    """Forgets the failed step, frees its partial files and builds the error to raise."""
    self._in_flight = None
    if step is not None and jax.process_index() == 0:
      self._remove_partial(step)
    self._mgr.reload()  # Orbax's step cache may have dropped steps that are still on disk
    good = self.latest_step()
    kept = (
      "there is no earlier checkpoint"
      if good is None
      else f"the last good checkpoint (step {good}) is untouched"
    )
    if _is_disk_full(error):
      fix = f"The disk is full: free space under {self.directory} (or pick another directory)"
    elif isinstance(error, OSError):
      fix = f"Check that {self.directory} is writable and has free space"
    else:  # e.g. a leaf Orbax cannot write
      fix = (
        "Fix the cause above (leaves must be jax.Arrays or numpy arrays; in a multi-process run, "
        "global jax.Arrays)"
      )
    return CheckpointSaveError(
      f"Saving checkpoint step {step} to {self.directory} failed "
      f"({type(error).__name__}: {error}); {kept}. {fix}, then save again."
    )

  def _remove_partial(self, step):
    """Deletes the failed step's temporary folder, freeing its space (a full disk stays full otherwise).

    Orbax reports the first failed write while its other writer threads may still touch the folder, so
    this retries until the folder stays gone; what remains is removed when a Checkpointer next opens it.
    """
    for _ in range(50):
      leftovers = list(self.directory.glob(f"{step}{_TMP_SUFFIX}*"))
      if not leftovers:
        return
      for tmp in leftovers:
        shutil.rmtree(tmp, ignore_errors=True)
      time.sleep(0.1)
    log.warning(
      "Could not remove the partial save of step %d under %s yet; it is ignored, and removed "
      "when a Checkpointer next opens the directory.",
      step,
      self.directory,
    )

  # -- reading -----------------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """The finalised steps on disk, oldest first (a save in flight or cut short is not one)."""
    if not self.directory.exists():
      return []
    return sorted(ocp.utils.checkpoint_steps(self.directory))

  def latest_step(self) -> int | None:
    """The newest finalised step on disk, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def metadata(self, step: int | None = None) -> dict:
    """The metadata saved with `step` (default: the latest), e.g. `["config"]`."""
    step = self._pick_step(step)
    return _strip_kind(self._read_meta(step))

  def restore(
    self, step: int | None = None, abstract_state=None, *, config=None, restore_data: bool = True
  ) -> Restored:
    """Restores `step` (default: the newest good one) onto the shardings of `abstract_state`.

    `abstract_state`: a pytree like the saved one whose leaves are `jax.ShapeDtypeStruct`s (with
    NamedShardings for any mesh: resharding happens here) or arrays; None restores host numpy arrays. Or a
    function from a step's saved leaf names (Orbax's dotted key paths, e.g. 'carry.pos', read from its
    metadata) to that pytree, called for each step tried: for a state whose layout changed between versions,
    built for whichever step the fallback below restores.
    `config` (a dataclass or dict), when given, must equal the saved `metadata["config"]`.
    With step=None a corrupt newest step is skipped (logged) in favour of the previous one.
    """
    self.wait_until_finished()
    if step is not None:
      return self._restore_step(self._pick_step(step), abstract_state, config, restore_data)
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(
        f"No finished checkpoint in {self.directory}. Train from scratch, or pass "
        "the directory that holds the <step>/ folders."
      )
    problems, bad = [], []
    for s in reversed(steps):
      try:
        restored = self._restore_step(s, abstract_state, config, restore_data)
      except CorruptCheckpointError as e:
        log.warning("Skipping checkpoint step %d: %s", s, e)
        problems.append(str(e))
        bad.append(s)
        continue
      for b in bad:  # an older step restored with the same inputs, so these are damaged on disk
        self._set_aside(b)
      return restored
    raise CorruptCheckpointError(
      f"No checkpoint in {self.directory} could be restored (steps {steps}). If every step fails the "
      "same way, suspect the abstract state's shardings rather than the files:\n  " + "\n  ".join(problems)
    )

  def _set_aside(self, step):
    """Renames a damaged step to `<step>.corrupt` (kept for inspection) so new saves can reuse its number."""
    if jax.process_index() == 0:
      dst = self.directory / f"{step}.corrupt"
      n = 0
      while dst.exists():
        n += 1
        dst = self.directory / f"{step}.corrupt-{n}"
      (self.directory / str(step)).rename(dst)
      log.warning("Moved damaged checkpoint step %d to %s.", step, dst)
    self._barriers += 1  # barrier names must be unique, and equal on every process
    ocp.multihost.sync_global_processes(f"laplace_jax_set_aside_{step}_{self._barriers}")
    self._mgr.reload()

  def _pick_step(self, step):
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"No finished checkpoint in {self.directory}. Train from scratch first.")
      return steps[-1]
    step = _check_step(step)
    if step not in steps:
      raise FileNotFoundError(
        f"Checkpoint step {step} is not in {self.directory} (finished steps: "
        f"{steps}). Pick one of those, or step=None for the latest."
      )
    return step

  def _read_meta(self, step) -> dict:
    try:
      meta = self._mgr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as e:
      raise self._corrupt(step, META, e) from e
    if not isinstance(meta, dict):
      raise self._corrupt(step, META, TypeError(f"expected a JSON object, found {type(meta).__name__}"))
    return meta

  def _restore_step(self, step, abstract_state, config, restore_data) -> Restored:
    meta = self._read_meta(step)
    if config is not None:
      check_config(meta.get("config"), config, where=f"checkpoint step {step} in {self.directory}")
    saved_tree = self._saved_tree(step)
    if callable(abstract_state):
      abstract_state = abstract_state({m.name for m in jax.tree.leaves(saved_tree)})
    if abstract_state is None:
      target = abstract_from_metadata(saved_tree)
    else:
      _check_structure(saved_tree, abstract_state, where=f"checkpoint step {step} in {self.directory}")
      target = abstract_state
    try:
      state = self._mgr.restore(
        step, args=ocp.args.Composite(**{TRAIN_STATE: ocp.args.StandardRestore(target)})
      )[TRAIN_STATE]
    except Exception as e:
      raise self._corrupt(step, TRAIN_STATE, e) from e
    data = self._restore_data(step, meta) if restore_data else None
    return Restored(step=step, train_state=state, data_state=data, metadata=_strip_kind(meta))

  def _saved_tree(self, step):
    try:
      return ocp.StandardCheckpointHandler().metadata(self._item_dir(step, TRAIN_STATE)).tree
    except Exception as e:
      raise self._corrupt(step, TRAIN_STATE, e) from e

  def _restore_data(self, step, meta):
    kind = meta.get(_KIND_KEY)
    if kind is None:
      return None
    d = self._item_dir(step, DATA_STATE)
    want = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    found = sorted(p.name for p in d.glob("process_*.json")) if d.exists() else []
    if found and not any(n.endswith(f"-of-{jax.process_count()}.json") for n in found):
      raise ValueError(
        f"Checkpoint step {step} in {self.directory} holds data-iterator states {found} "
        f"but this run has {jax.process_count()} process(es) (needs {want}). Resume with "
        "the same process count, or pass restore_data=False to restart the data stream."
      )
    box = _DataStateBox()
    try:
      self._mgr.restore(step, args=ocp.args.Composite(**{DATA_STATE: grain_ckpt.CheckpointRestore(box)}))
      return box.decoded(kind)
    except Exception as e:
      raise self._corrupt(step, DATA_STATE, e) from e

  def _item_dir(self, step, item):
    return self.directory / str(step) / item

  def _corrupt(self, step, item, error) -> CorruptCheckpointError:
    return CorruptCheckpointError(
      f"Checkpoint step {step} in {self.directory} is corrupt or incomplete: its '{item}' item cannot "
      f"be read ({type(error).__name__}: {error}). Restore another step (finished: {self.all_steps()}), "
      f"or delete {self.directory / str(step)} if it is damaged for good."
    )


# -- params-only export --------------------------------------------------------------------------


def export_params(params, path, *, config=None, save_concurrent_gb: int | None = None) -> None:
  """Writes params (and the config, if given) to a new directory `path` for serving; synchronous.
  `save_concurrent_gb` (at least the largest leaf's GB): Orbax writes at most that many GB of leaves at once, so
  the compressed copies it makes on the host stay that small (None: Orbax's default, 96)."""
  path = epath.Path(path).absolute()
  if path.exists():
    raise FileExistsError(
      f"Export path {path} already exists. Pick a new path, or delete the old "
      "export first (exports are never overwritten)."
    )
  items = {"params": ocp.args.StandardSave(params)}
  if config is not None:
    items["config"] = ocp.args.JsonSave(_config_dict(config))
  handlers = {}
  if save_concurrent_gb is not None:  # named handlers: every item's, or Orbax finds none for the others
    handlers = {"params": ocp.StandardCheckpointHandler(save_concurrent_gb=save_concurrent_gb)}
    if config is not None:
      handlers["config"] = ocp.JsonCheckpointHandler()
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers)) as ckptr:
    ckptr.save(path, args=ocp.args.Composite(**items))


def load_params(path, abstract_params=None, *, shardings=None, config=None):
  """Loads exported params onto `abstract_params`' shardings, or onto `shardings` (one Sharding or a
  pytree of them), or as host numpy arrays when neither is given; checks `config` if given."""
  if abstract_params is not None and shardings is not None:
    raise ValueError(
      "load_params got both abstract_params and shardings. Pass one: abstract_params "
      "carries its own shardings."
    )
  path = epath.Path(path).absolute()
  if not (path / "params").exists():
    raise FileNotFoundError(
      f"No exported params at {path} (expected {path / 'params'}). Pass the "
      "directory written by export_params."
    )
  if config is not None:
    saved = _read_json(path / "config" / "metadata") if (path / "config").exists() else None
    check_config(saved, config, where=f"export {path}")
  try:
    saved_tree = ocp.StandardCheckpointHandler().metadata(path / "params").tree
  except Exception as e:
    raise CorruptCheckpointError(
      f"Export {path} is corrupt or incomplete: its params metadata cannot be "
      f"read ({type(e).__name__}: {e}). Export the params again."
    ) from e
  if abstract_params is None:
    target = abstract_from_metadata(saved_tree, shardings)
  else:
    _check_structure(saved_tree, abstract_params, where=f"export {path}")
    target = abstract_params
  try:
    with ocp.StandardCheckpointer() as ckptr:
      return ckptr.restore(path / "params", target)
  except Exception as e:
    raise CorruptCheckpointError(
      f"Export {path} is corrupt or incomplete: its params cannot be read "
      f"({type(e).__name__}: {e}). Export the params again."
    ) from e


def export_config(path, *, preset: str | None = None):
  """The model config saved with an export of `python -m train` (checked against `preset` when given)."""
  path = epath.Path(path).absolute()
  if not (path / "params").exists():
    raise FileNotFoundError(
      f"checkpoint {path}: no exported params there (expected {path / 'params'}); "
      "pass RUN/export/step_N as written by python -m train."
    )
  if not (path / "config").exists():
    raise ValueError(
      f"checkpoint {path} has no saved config, so its model is unknown; export it with "
      "checkpoint.export_params(params, path, config=cfg)."
    )
  saved = _read_json(path / "config" / "metadata")
  try:
    cfg = LaplaceConfig(**saved)
  except TypeError as e:
    raise ValueError(
      f"checkpoint {path}: its config {saved} is not a LaplaceConfig of this version ({e})."
    ) from e
  if preset:
    check_config(saved, get_config(preset), where=f"checkpoint {path} (checked against preset {preset})")
  return cfg


def load_export(path, shardings=None, *, preset: str | None = None):
  """(params, model config) of an export written by `python -m train` (RUN/export/step_N): the model is
  built from the config saved beside the params, so any trained config loads, preset or not. `shardings`
  is one Sharding, or a function from the abstract params to a pytree of shardings (None: host numpy);
  `preset`, when given, refuses an export of another config. The loader of train.eval and python -m serve."""
  path = epath.Path(path).absolute()
  cfg = export_config(path, preset=preset)
  abstract = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  if callable(shardings):
    shardings = shardings(abstract)
  if shardings is not None:
    shardings = (
      jax.tree.map(lambda _: shardings, abstract)
      if isinstance(shardings, jax.sharding.Sharding)
      else shardings
    )
    abstract = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
  return load_params(path, abstract if shardings is not None else None, config=cfg), cfg


# -- helpers shared by both ------------------------------------------------------------------------


def abstract_from_metadata(saved_tree, shardings=None):
  """ShapeDtypeStructs for a saved Orbax tree placed on `shardings` (one or a pytree), else numpy."""
  if shardings is None:
    return jax.tree.map(lambda m: np.empty(m.shape, m.dtype), saved_tree)
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=shardings), saved_tree)
  return jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=s), saved_tree, shardings)


def check_config(saved, given, *, where: str) -> None:
  """Raises ValueError naming every field where `given` differs from the `saved` config dict (fields in
  LAYOUT_NEUTRAL excepted). A field of a given config dataclass that the saved dict lacks (saved before the
  field existed) counts as its default."""
  if saved is None:
    raise ValueError(f"{where} has no saved config to compare with. Pass config=None to skip the check.")
  if dataclasses.is_dataclass(given) and not isinstance(given, type):
    saved = {
      **{f.name: f.default for f in dataclasses.fields(given) if f.default is not dataclasses.MISSING},
      **saved,
    }
    saved = json.loads(json.dumps(saved, default=_json_default))
  given = json.loads(json.dumps(_config_dict(given)))  # tuples → lists, as they were saved
  missing = object()
  diffs = [
    f"{k}: saved {saved.get(k, '<absent>')!r}, given {given.get(k, '<absent>')!r}"
    for k in sorted((set(saved) | set(given)) - LAYOUT_NEUTRAL)
    if saved.get(k, missing) != given.get(k, missing)
  ]
  if diffs:
    raise ValueError(
      f"{where} was saved with a different config ({'; '.join(diffs)}). Restore with the "
      "saved config (Checkpointer.metadata()['config']), or use a new checkpoint directory "
      "to start a fresh run."
    )


def _check_structure(saved_tree, abstract, *, where: str) -> None:
  """Raises ValueError if the leaves' names or shapes differ between the checkpoint and `abstract`."""
  saved = {m.name: tuple(m.shape) for m in jax.tree.leaves(saved_tree)}
  wanted = {_leaf_name(p): _saved_shape(x) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  diffs = [f"{k} missing from the checkpoint" for k in sorted(set(wanted) - set(saved))]
  diffs += [f"{k} in the checkpoint but not in the abstract state" for k in sorted(set(saved) - set(wanted))]
  diffs += [
    f"{k}: saved shape {saved[k]}, expected {wanted[k]}"
    for k in sorted(set(saved) & set(wanted))
    if wanted[k] is not None and saved[k] != wanted[k]
  ]
  if diffs:
    more = f" (and {len(diffs) - 8} more)" if len(diffs) > 8 else ""
    raise ValueError(
      f"{where} does not match the abstract state: {'; '.join(diffs[:8])}{more}. Build the "
      "abstract state from the config the checkpoint was saved with."
    )


def _leaf_name(path) -> str:
  """Orbax's name for a leaf: its key path joined with dots (e.g. 'opt_state.0.mu.w')."""
  parts = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
  return ".".join(str(p) for p in parts)


def _saved_shape(x):
  """The shape Orbax stores for `x`: typed PRNG keys are stored as their uint32 key data."""
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, x).shape)
  return tuple(x.shape) if hasattr(x, "shape") else None


class _DataStateBox:
  """Carries a data-iterator state through grain's Orbax handler, which calls get/set_state on it."""

  def __init__(self, state=None):
    self.state = state

  def get_state(self) -> bytes:
    if isinstance(self.state, bytes):
      return self.state
    return json.dumps(self.state, default=_json_default).encode()

  def set_state(self, state: bytes):
    self.state = state

  def start_prefetch(self):
    pass

  def decoded(self, kind):
    return self.state if kind == "bytes" else json.loads(self.state)


def _meta_json(metadata, data_state) -> dict:
  """The JSON object saved as the `meta` item; fails now (not in a background thread) if not JSON-able."""
  meta = dict(metadata or {})
  if _KIND_KEY in meta:
    raise ValueError(f"metadata key {_KIND_KEY!r} is reserved by laplace_jax.training.checkpoint. Rename it.")
  if "config" in meta:
    meta["config"] = _config_dict(meta["config"])
  if data_state is not None and not isinstance(data_state, (dict, bytes)):
    raise TypeError(
      f"data_state of type {type(data_state).__name__}: expected a dict (grain "
      "DatasetIterator.get_state()) or bytes (DataLoaderIterator.get_state())."
    )
  meta[_KIND_KEY] = None if data_state is None else ("bytes" if isinstance(data_state, bytes) else "dict")
  for name, value in (("metadata", meta), ("data_state", data_state)):
    if isinstance(value, bytes):
      continue
    try:
      json.dumps(value, default=_json_default)
    except (TypeError, ValueError) as e:
      raise TypeError(
        f"{name} is not JSON-serialisable ({e}). Keep it to dicts, lists, strings, "
        "numbers and bools (config dataclasses are converted for you)."
      ) from e
  return json.loads(json.dumps(meta, default=_json_default))


def _config_dict(config) -> dict:
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    return dataclasses.asdict(config)
  if isinstance(config, dict):
    return dict(config)
  raise TypeError(f"config of type {type(config).__name__}: expected a config dataclass or a dict.")


def _json_default(x):
  if isinstance(x, (np.integer, np.floating, np.bool_)):
    return x.item()
  raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def _strip_kind(meta: dict) -> dict:
  return {k: v for k, v in meta.items() if k != _KIND_KEY}


def _read_json(path):
  return json.loads(epath.Path(path).read_text())


def _check_step(step) -> int:
  if (
    isinstance(step, bool)
    or not isinstance(step, (int, np.integer))
    and not (hasattr(step, "shape") and step.shape == () and np.issubdtype(step.dtype, np.integer))
  ):
    raise TypeError(f"step={step!r}: expected a non-negative integer. Pass the training step number.")
  step = int(step)
  if step < 0:
    raise ValueError(f"step={step}: expected a non-negative integer. Pass the training step number.")
  return step


def _is_disk_full(error) -> bool:
  text = str(error)
  return (
    getattr(error, "errno", None) == errno.ENOSPC or "No space left" in text or "RESOURCE_EXHAUSTED" in text
  )
