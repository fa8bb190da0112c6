"""The command lines' one flag style (laplace_jax.cli): help on every flag, from the config fields'
docstrings for `python -m train`; underscores shown, the dashed spelling parsed to the same value."""

import dataclasses

import pytest

from laplace_jax import cli
from laplace_jax.model.config import LaplaceConfig
from laplace_jax.training.optimizer import OptimizerConfig
from serve import __main__ as serve_main
from serve.api import server_config
from serve.api.server_config import ServerConfig
from serve.engine.engine_config import EngineConfig
from train import eval as train_eval
from train import export_hf, import_hf
from train import prepare as train_prepare
from train import recall as train_recall
from train import run_config as train_config

# (parser, the arguments it requires)
PARSERS = {
  "train": (train_config.build_parser, []),
  "train.eval": (train_eval.build_parser, ["--checkpoint", "c", "--data_dir", "d"]),
  "train.recall": (train_recall.build_parser, []),
  "serve": (serve_main.build_parser, []),
  "train.prepare": (train_prepare.build_parser, []),
  "train.export_hf": (export_hf.build_parser, ["--checkpoint", "c", "-o", "d"]),
  "train.import_hf": (import_hf.build_parser, ["d", "-o", "o"]),
}


def _flags(parser):
  return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _value(action) -> list[str]:
  """A value the flag accepts, as arguments after it."""
  if action.nargs == 0:
    return []
  if action.choices:
    return [str(list(action.choices)[-1])]
  return {int: ["3"], float: ["0.5"]}.get(
    action.type, ["true"] if action.type is train_config._parse_bool else ["x3"]
  )


@pytest.mark.parametrize("name", PARSERS)
def test_every_flag_has_help_and_one_spelling(name):
  parser = PARSERS[name][0]()
  for action in _flags(parser):
    assert action.help and len(action.help) > 12, (name, action.option_strings)
    for s in action.option_strings:
      assert not (s.startswith("--") and "-" in s[2:]), (name, s)


@pytest.mark.parametrize("name", PARSERS)
def test_dashed_spelling_parses_to_the_same_value(name):
  make, required = PARSERS[name]
  parser = make()
  checked = 0
  for action in _flags(parser):
    for flag in action.option_strings:
      dashed = "--" + flag[2:].replace("_", "-")
      if not flag.startswith("--") or dashed == flag:
        continue
      value = _value(action)
      want = parser.parse_args(required + [flag, *value])
      got = parser.parse_args(required + [dashed, *value])
      assert vars(got) == vars(want), (name, flag)
      assert getattr(got, action.dest) != action.default or action.nargs == 0, (name, flag)
      checked += 1
      if value:  # --flag=value too
        assert vars(parser.parse_args(required + [f"{dashed}={value[0]}"])) == vars(want), (name, flag)
  least = {
    "train": 60,
    "train.eval": 8,
    "train.recall": 1,
    "serve": 20,
    "train.prepare": 6,
    "train.export_hf": 1,
  }
  assert checked >= least.get(name, 0)


def test_train_flags_help_is_the_field_docstring():
  parser = train_config.build_parser()
  helps = {a.dest: a.help for a in _flags(parser)}
  for section, cls in (
    ("train", train_config.TrainConfig),
    ("model", LaplaceConfig),
    ("optimizer", OptimizerConfig),
  ):
    for f in dataclasses.fields(cls):
      doc = cli.field_help(cls, f.name)
      assert doc, f"{cls.__name__}.{f.name} has no docstring (the line after the field)"
      assert helps[f"{section}.{f.name}"].startswith(doc)
  assert cli.field_help(LaplaceConfig, "d_model") == "hidden width D"


def test_toggle_and_dashed_negation():
  rc = train_config.load_config(["--no-resume", "--state-passing", "--model.d-model", "32"])
  assert (rc.train.resume, rc.train.state_passing, rc.model.d_model) == (False, True, 32)
  rc = train_config.load_config(["--no_state_passing", "--resume"])
  assert (rc.train.resume, rc.train.state_passing) == (True, False)
  assert "--no_progress" in train_config.build_parser().format_usage()


def test_serve_takes_both_spellings():
  a = serve_main.parse_args(
    ["--random-init", "--n-slots", "3", "--state-cache-gb", "0", "--hlo-dir", "h", "--target", "neuron"]
  )
  b = serve_main.parse_args(
    ["--random_init", "--n_slots", "3", "--state_cache_gb", "0", "--hlo_dir", "h", "--target", "neuron"]
  )
  assert vars(a) == vars(b) and (a.n_slots, a.random_init, a.hlo_dir) == (3, True, "h")
  with pytest.raises(SystemExit):
    serve_main.parse_args(["--random_init", "--random-init", "--checkpoint", "c"])  # still exclusive


def test_serve_flags_are_the_config_fields(monkeypatch):
  """python -m serve's flags: ServerConfig's fields and the engine's (EngineConfig), each with its field's
  docstring as its help and its field's default."""
  monkeypatch.delenv("LAPLACE_API_KEY", raising=False)
  flags = {a.dest: a for a in _flags(serve_main.build_parser())}
  fields = {f.name: (ServerConfig, f.name) for f in dataclasses.fields(ServerConfig)}
  fields |= {flag: (EngineConfig, name) for flag, name in server_config.ENGINE_FLAGS.items()}
  assert set(flags) == set(fields)
  for flag, (cls, name) in fields.items():
    assert cli.field_help(cls, name), f"{cls.__name__}.{name} has no docstring (the line after the field)"
    assert flags[flag].help == cli.field_help(cls, name)
  engine, server = server_config.configs(serve_main.parse_args(["--random_init"]))
  assert engine == EngineConfig()
  assert server == ServerConfig(random_init=True, preset="small", mesh_devices=1)  # parse_args fills these
  engine, server = server_config.configs(
    serve_main.parse_args(["--checkpoint", "c", "--state_snapshot_every", "3", "--allowed_host", "h"])
  )
  assert (engine.snapshot_every, server.allowed_host) == (3, ("h",))


def test_dashed_flag_definition_is_refused_and_values_are_left_alone():
  p = cli.FlagParser()
  with pytest.raises(ValueError, match="--hlo_dir"):
    p.add_argument("--hlo-dir")
  with pytest.raises(ValueError, match="--hlo_dir"):
    p.add_argument_group("g").add_argument("--hlo-dir")
  p.add_argument("--prompt")
  p.add_argument("rest", nargs="*")
  # a value that looks like a dashed flag is no known flag, so it stays as written; after `--` nothing changes
  assert p.parse_args(["--prompt=--x-y", "--", "--prompt"]).rest == ["--prompt"]
  assert p.parse_args(["--prompt=--x-y"]).prompt == "--x-y"


def test_serve_flags_load_no_jax():
  """`python -m serve --help` stays quick: its flags (EngineConfig, ServerConfig, the presets) import neither
  JAX, Flax nor Orbax. And its log reaches stderr: a library that set up the root logger on import (absl's
  handler, through Orbax) would make main's logging.basicConfig a no-op and hide the "serving ... on URL"
  line clients wait for."""
  import subprocess
  import sys

  code = (
    "import sys, serve.__main__ as m; m.build_parser().format_help(); "
    "print(sorted({n.split('.')[0] for n in sys.modules} & {'jax', 'flax', 'orbax'}))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr
