"""`python -m train`'s checks before any compile: data, eval batch, TOML types, unknown flags, seq_len."""

import dataclasses

import pytest

from laplace_jax.model.config import get_config
from laplace_jax.model.counts import flops_per_token
from train import prepare
from train.loop import check_data
from train.run_config import load_config

PARAGRAPHS = "\n\n".join(f"Paragraph {i}: " + "words of the text go on " * 20 for i in range(40))


def _prepared(tmp_path, *args):
  (tmp_path / "my.txt").write_text(PARAGRAPHS)
  out = tmp_path / "data"
  assert prepare.main([str(tmp_path / "my.txt"), "-o", str(out), "--no_progress", *args]) == 0
  return out


def _train(data_dir, *flags):
  return load_config(["--data_dir", str(data_dir), *flags]).train


def test_missing_data_dir_names_prepare(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no such directory.*python -m train.prepare YOUR_FILE.txt"):
    check_data(_train(tmp_path / "nope"), 64, 50304, 1)
  with pytest.raises(FileNotFoundError, match="no manifest.json there"):
    check_data(_train(tmp_path), 64, 50304, 1)


def test_small_val_split_names_the_eval_batch_that_fits(tmp_path):
  d = _prepared(tmp_path, "--txt_separator", "\\n\\n", "--val_fraction", "0.2")
  with pytest.raises(ValueError, match=r"fewer than one eval batch of --eval_batch 16 .*Use --eval_batch 4,"):
    check_data(_train(d), 256, 50304, 1)
  with pytest.raises(ValueError, match="multiple of the 8 devices a batch is split over; use --eval_batch 8"):
    check_data(_train(d, "--eval_batch", "4"), 256, 50304, 8)
  check_data(_train(d, "--eval_batch", "4"), 256, 50304, 1)  # fits: no error
  check_data(_train(d, "--eval_batches", "0"), 256, 50304, 1)


def test_empty_val_split_names_the_fix(tmp_path):
  d = _prepared(tmp_path, "--val_fraction", "0.2", "--txt_separator", "NEVER")
  with pytest.raises(ValueError, match=r"val split has no documents.*--eval_batches 0"):
    check_data(_train(d), 64, 50304, 1)


def test_bad_toml_types_are_one_error_for_every_table(tmp_path):
  toml = tmp_path / "run.toml"
  toml.write_text('[train]\nsteps = "100"\nseed = 1.5\n[model]\nd_model = "x"\n[optimizer]\nmuon_lr = 1\n')
  with pytest.raises(ValueError, match="3 value") as e:
    load_config(["--config", str(toml)])
  for want in ("[train] steps = '100'", "[train] seed = 1.5", "[model] d_model = 'x'"):
    assert want in str(e.value)
  assert "muon_lr" not in str(e.value)  # an int is a valid float


def test_unknown_flag_names_the_closest(capsys):
  with pytest.raises(SystemExit):
    load_config(["--setps", "5", "--d_model", "8"])
  err = capsys.readouterr().err
  assert "did you mean --steps?" in err and "did you mean --model.d_model?" in err
  assert len(err.splitlines()) == 2


@pytest.mark.parametrize("seq_len", [64, 96, 100, 200, 256])
def test_flops_for_any_seq_len(seq_len):
  cfg = get_config("tiny")
  assert flops_per_token(cfg, seq_len=seq_len) > 0
  if seq_len == cfg.max_seq_len:
    assert flops_per_token(cfg, seq_len=seq_len) == flops_per_token(cfg)
  assert dataclasses.replace(cfg) == cfg  # the config is not rebuilt with another chunk size


def _flag_help(text: str, flag: str) -> str:
  """The help of one flag in a --help text, whitespace collapsed."""
  lines = text.splitlines()
  at = next(i for i, l in enumerate(lines) if l.strip().startswith(flag + " "))
  block = [lines[at]]
  for l in lines[at + 1 :]:
    if l.strip().startswith("-") or not l.startswith(" "):
      break
    block.append(l)
  return " ".join(" ".join(block).split())


@pytest.mark.parametrize("preset", ["tiny", "laplace-3b"])
def test_train_help_shows_the_chosen_presets_defaults(preset):
  from train.run_config import build_parser, chosen_preset

  argv = [] if preset == "tiny" else ["--preset", preset]
  text = build_parser(chosen_preset(argv)).format_help()
  d_model = get_config(preset).d_model
  assert _flag_help(text, "--model.d_model").endswith(f"(default: {d_model})")
  assert f"defaults: --preset {preset}'s" in text


def test_train_help_reads_the_preset_from_the_toml(tmp_path):
  from train.run_config import chosen_preset

  (tmp_path / "r.toml").write_text('[train]\npreset = "small"\n')
  assert chosen_preset(["--config", str(tmp_path / "r.toml")]) == "small"
  assert chosen_preset(["--config", str(tmp_path / "r.toml"), "--preset", "tiny"]) == "tiny"


def test_serve_help_prints_each_default_once():
  from serve.__main__ import build_parser

  text = " ".join(build_parser().format_help().split())
  assert "(default: None)" not in text
  assert "(default: 1280 for laplace-3b, 64 otherwise)" in text
  assert not any(s.count("(default") > 1 for s in text.split(" --"))
