"""`python -m serve --checkpoint RUN/export/step_N` builds the model from the config saved with the export:
a run trained with a config no preset has serves from its export alone, greedy
tokens equal to the exported params' own model; --preset only checks it; train.eval loads it alike."""

import jax
import numpy as np
import pytest
from helpers import serve_fixtures as sf

from laplace_jax import model
from laplace_jax.training import checkpoint
from serve import __main__ as serve_main
from train import prepare
from train.loop import run
from train.run_config import load_config


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  root = tmp_path_factory.mktemp("serve_export")
  prepare.main(["--corpus", "kjv", "-o", str(root / "kjv"), "--max-documents", "20", "--no-progress"])
  summary = run(
    load_config(
      [
        "--preset",
        "tiny",
        "--model.d_model",
        "96",
        "--global_batch",
        "8",
        "--seq_len",
        "64",
        "--steps",
        "1",
        "--save_every",
        "100",
        "--log_every",
        "1",
        "--no-progress",
        "--data_dir",
        str(root / "kjv"),
        "--out_dir",
        str(root / "run"),
      ]
    )
  )
  return summary["export"]


def test_a_non_preset_run_serves_from_its_export_alone(export):
  server = serve_main.build(
    serve_main.parse_args(
      [
        "--checkpoint",
        export,
        "--n-slots",
        "2",
        "--slot-buckets",
        "table",
        "--prefill-batch",
        "1",
        "--state-cache-gb",
        "0",
        "--params-dtype",
        "param",
      ]
    )
  )
  assert server.engine.cfg.d_model == 96 and server.limits.model_name == "laplace-step_1"
  params, cfg = checkpoint.load_export(export)
  prompt = [464, 1110, 318]
  ids = list(prompt)
  # Greedy continuation from the exported params, by the model itself: each step's forward reads the
  # logits at the last real position of one fixed-length row (the model is causal: the zeros padded after
  # it change nothing there), so the four steps run one compiled forward.
  n = len(prompt) + 3
  for _ in range(4):
    row = np.array([ids + [0] * (n - len(ids))])
    ids.append(int(np.argmax(np.asarray(model.forward(params, row, cfg=cfg))[0, len(ids) - 1, :50257])))
  with sf.serving(server.engine, server.tok, server.limits) as (url, _):
    st, out = sf.call(
      url,
      body={
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
      },
    )
  assert st == 200, out
  assert out["model"] == "laplace-step_1" and out["choices"][0]["token_ids"] == ids[len(prompt) :]


def test_preset_with_checkpoint_only_checks_the_saved_config(export):
  with pytest.raises(SystemExit, match="d_model"):
    serve_main.main(["--checkpoint", export, "--preset", "tiny"])
  params, cfg = checkpoint.load_export(export, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  assert cfg.d_model == 96 and isinstance(jax.tree.leaves(params)[0], jax.Array)
