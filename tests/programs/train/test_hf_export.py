"""`python -m train.export_hf` and `train.import_hf` without PyTorch: the directory's files, its tensors read
by the `safetensors` package (the independent reader) against the params in PyTorch's layout, shards of
bounded size, export then import bit-identical (fp32 and bf16, with and without the FFN), and directories
that do not fit the architecture refused with the field or tensor named."""

import hashlib
import json

import numpy as np
import pytest
from helpers.hf_fixtures import assert_same_export, make_export

from laplace_jax.data import tokenizer
from laplace_jax.model.config import get_config
from serve.slots import loading
from train import export_hf, hf, import_hf

safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  src, params = make_export(root / "export")
  out = export_hf.export(src, root / "hf")
  return src, params, out


def test_directory_holds_what_transformers_loads(tiny):
  _, _, out = tiny
  names = {p.name for p in out.iterdir()}
  assert {
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "configuration_laplace.py",
    "modeling_laplace.py",
  } <= names
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == "laplace"
  assert config["auto_map"] == {
    "AutoConfig": "configuration_laplace.LaplaceConfig",
    "AutoModelForCausalLM": "modeling_laplace.LaplaceForCausalLM",
  }
  cfg = get_config("tiny")
  assert (config["d_model"], config["n_layers"], config["d_k"], config["d_v"]) == (64, 2, 8, 16)
  assert config["n_decay_tiers"] == cfg.n_decay_tiers and config["dtype"] == "float32"
  gen = json.loads((out / "generation_config.json").read_text())
  assert gen["eos_token_id"] == tokenizer.EOS_ID
  assert gen["suppress_tokens"] == list(range(50257, 50304))  # the padded rows, never drawn
  files = tokenizer.bpe_files()
  sha = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()
  assert sha(out / "vocab.json") == sha(files["encoder.json"])
  assert sha(out / "merges.txt") == sha(files["vocab.bpe"])
  assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "GPT2Tokenizer"


def test_tensors_are_the_params_in_pytorch_layout(tiny):
  _, params, out = tiny
  t = safetensors_numpy.load_file(str(out / "model.safetensors"))
  L = params["layers"]
  assert len(t) == 3 + 2 * 11  # embed, final norm, head; 11 tensors per layer
  np.testing.assert_array_equal(t["model.embed_tokens.weight"], params["embed"])
  np.testing.assert_array_equal(t["lm_head.weight"], params["lm_head"].T)  # nn.Linear: [out, in]
  np.testing.assert_array_equal(t["model.norm.weight"], params["final_norm_scale"])
  for i in range(2):
    p = f"model.layers.{i}."
    np.testing.assert_array_equal(t[p + "mixer.qkvg_proj.weight"], L["w_qkvg"][i].T)
    np.testing.assert_array_equal(t[p + "mixer.out_proj.weight"], L["w_out"][i].T)
    np.testing.assert_array_equal(t[p + "ffn.w1.weight"], L["w1"][i].T)
    np.testing.assert_array_equal(t[p + "ffn.w3.weight"], L["w3"][i].T)
    assert t[p + "conv.weight"].shape == (64, 1, 4)  # nn.Conv1d(D, D, 4, groups=D)
    for tap in range(4):
      np.testing.assert_array_equal(t[p + "conv.weight"][:, 0, tap], L["conv_kernel"][i][tap])
    np.testing.assert_array_equal(t[p + "mixer.head_norm.weight"], L["head_norm_scale"][i])
    np.testing.assert_array_equal(t[p + "mixer.aug_balance"], L["aug_balance"][i])
    np.testing.assert_array_equal(t[p + "mixer_norm.weight"], L["ln1_scale"][i])
    np.testing.assert_array_equal(t[p + "ffn_norm.weight"], L["ln2_scale"][i])


def test_export_then_import_is_bit_identical_and_serves(tiny, tmp_path):
  src, params, out = tiny
  back = import_hf.import_directory(out, tmp_path / "back")
  assert_same_export(src, back)
  served, cfg = loading.load_model(checkpoint=str(back), dtype="param")  # what python -m serve loads
  assert cfg == get_config("tiny")
  np.testing.assert_array_equal(np.asarray(served["layers"]["w2"]), params["layers"]["w2"])


def test_shards_stay_under_the_bound_and_round_trip(tmp_path):
  src, _ = make_export(tmp_path / "export", seed=1, param_dtype="bfloat16", ffn=False)
  out = export_hf.export(src, tmp_path / "hf", max_shard_bytes=export_hf.parse_size("4MB"))
  index = json.loads((out / hf.INDEX_FILE).read_text())
  shards = sorted(p for p in out.glob("model-*.safetensors"))
  assert len(shards) >= 2 and sorted(set(index["weight_map"].values())) == [p.name for p in shards]
  embed_bytes = 50304 * 64 * 2
  total = 0
  for p in shards:
    t = safetensors_numpy.load_file(str(p))
    size = sum(x.nbytes for x in t.values())
    total += size
    assert size <= 4_000_000 or len(t) == 1 and size == embed_bytes  # a tensor past the bound: alone
    assert all(x.dtype.name == "bfloat16" for x in t.values())
    assert all(index["weight_map"][n] == p.name for n in t)
  assert index["metadata"]["total_size"] == total
  assert not any("ffn" in n for n in index["weight_map"])
  assert_same_export(src, import_hf.import_directory(out, tmp_path / "back"))


def test_reader_reads_files_the_safetensors_package_wrote(tmp_path):
  import ml_dtypes

  rng = np.random.default_rng(0)
  arrays = {
    "a": rng.standard_normal((3, 5)).astype(np.float32),
    "b": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
    "c": rng.standard_normal((2, 1, 4)).astype(np.float16),
  }
  safetensors_numpy.save_file(arrays, str(tmp_path / "x.safetensors"))
  f = hf.SafetensorsFile(tmp_path / "x.safetensors")
  for name, x in arrays.items():
    y = f.tensor(name)
    assert y.dtype == x.dtype and np.array_equal(y.view(np.uint8), x.view(np.uint8))


def test_parse_size():
  assert export_hf.parse_size("5GB") == 5 * 10**9
  assert export_hf.parse_size("2GiB") == 2 * 2**30
  assert export_hf.parse_size("500mb") == 500 * 10**6
  assert export_hf.parse_size("1000") == 1000
  with pytest.raises(ValueError, match="max_shard_size"):
    export_hf.parse_size("five")


def _copy(out, dst):
  import shutil

  shutil.copytree(out, dst)
  return dst


def _edit_config(d, **changes):
  config = json.loads((d / "config.json").read_text())
  for k, v in changes.items():
    if v is None:
      del config[k]
    else:
      config[k] = v
  (d / "config.json").write_text(json.dumps(config))


def _edit_tensors(d, edit):
  t = safetensors_numpy.load_file(str(d / "model.safetensors"))
  edit(t)
  safetensors_numpy.save_file(t, str(d / "model.safetensors"))


@pytest.mark.parametrize(
  "config_changes, named",
  [
    ({"model_type": "gpt2"}, "model_type"),
    ({"d_k": None}, "d_k"),
    ({"n_decay_tiers": 3}, "n_decay_tiers"),
    ({"mixers": "GA"}, "mixers"),
    ({"d_ff": 96}, "ffn.w1.weight"),  # the config no longer describes the tensors
  ],
)
def test_a_config_that_does_not_fit_is_refused_by_name(tiny, tmp_path, config_changes, named):
  d = _copy(tiny[2], tmp_path / "bad")
  _edit_config(d, **config_changes)
  with pytest.raises(hf.HFDirectoryError, match=named):
    import_hf.import_directory(d, tmp_path / "out")
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
  "edit, named",
  [
    (lambda t: t.pop("model.layers.1.mixer.aug_balance"), r"model\.layers\.1\.mixer\.aug_balance is missing"),
    (lambda t: t.update(extra=np.zeros(2, np.float32)), "extra is not a tensor of this architecture"),
    (
      lambda t: t.update({"lm_head.weight": np.zeros((64, 50304), np.float32)}),
      r"lm_head\.weight has shape \[64, 50304\], expected \[50304, 64\]",
    ),
    (lambda t: t.update({"model.norm.weight": np.ones(64, np.float16)}), "mix dtypes"),
  ],
)
def test_tensors_that_do_not_fit_are_refused_by_name(tiny, tmp_path, edit, named):
  d = _copy(tiny[2], tmp_path / "bad")
  _edit_tensors(d, edit)
  with pytest.raises(hf.HFDirectoryError, match=named):
    import_hf.import_directory(d, tmp_path / "out")


def test_a_gla_only_model_exports(tmp_path):
  with pytest.raises(hf.HFDirectoryError, match="mixers='GA'"):
    hf.tensor_table(get_config("tiny", mixers="GA"))


def test_existing_outputs_are_kept_unless_overwrite(tiny, tmp_path, capsys):
  src, _, out = tiny
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "notes.txt").write_text("mine")
  argv = ["--checkpoint", str(src), "-o", str(tmp_path / "taken")]
  assert export_hf.main(argv) == 2
  assert "already exists" in capsys.readouterr().err
  assert export_hf.main([*argv, "--overwrite"]) == 2  # not a directory it wrote: never replaced
  assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
  assert import_hf.main([str(out), "-o", str(tmp_path / "taken"), "--overwrite"]) == 2
  assert "not replaced" in capsys.readouterr().err
  again = _copy(out, tmp_path / "again")
  assert export_hf.main(["--checkpoint", str(src), "-o", str(again), "--overwrite"]) == 0
  assert import_hf.main([str(again), "-o", str(tmp_path / "back")]) == 0
  assert import_hf.main([str(again), "-o", str(tmp_path / "back")]) == 2
  assert import_hf.main([str(again), "-o", str(tmp_path / "back"), "--overwrite"]) == 0
  assert_same_export(src, tmp_path / "back")
