"""Same-run A/B of the engine's generate step: decode and sampling as two compiled calls (what serve/slots.py
does) against one compiled program (what it did before issue 11), beside the bare decode_step; greedy,
`tiny`, rounds alternating the three (docs/BENCHMARKS.md, "Engine overhead").

    python benchmarks/engine_ab.py SLOTS ROUNDS
"""
import time, sys, numpy as np, jax, jax.numpy as jnp
from laplace_jax.config import get_config
from serve.engine import Engine, Request
from serve.bench import laplace_params, LaplaceStep
c = int(sys.argv[1]); rounds = int(sys.argv[2]); cfg = get_config("tiny")
params = laplace_params(cfg, "compute")
rng = np.random.default_rng(0)
def mk(fused):
  e = Engine(params, cfg, n_slots=c, prefill_batch=min(c, 64), max_queue=0, valid_vocab=50257)
  if fused:
    f = e.fns
    one = jax.jit(lambda p, t: f._sample_next(*f._decode_logits(p, t)[::-1]), donate_argnums=1)  # the old program
    f.generate = one
  e.warmup()
  for _ in range(c):
    e.submit(Request(prompt_ids=rng.integers(0, 50257, 16).tolist(), max_tokens=1 << 20))
  while e.queue or e.prefill is not None: e.step()
  e.step()
  return e
E = {"split": mk(False), "fused": mk(True)}
bare = LaplaceStep(params, cfg, c); bare()
def t_engine(e, n=10):
  tok0, t0 = e.stats["tokens"], time.perf_counter()
  for _ in range(n): e.step()
  return (time.perf_counter() - t0) * c / (e.stats["tokens"] - tok0)
def t_bare(n=10):
  t0 = time.perf_counter()
  for _ in range(n): bare()
  return (time.perf_counter() - t0) / n
r = {"split": [], "fused": [], "bare": []}
for _ in range(rounds):
  r["split"].append(t_engine(E["split"])); r["bare"].append(t_bare()); r["fused"].append(t_engine(E["fused"]))
b = np.median(r["bare"])
print(c, {k: f"{np.median(v)*1e3:.2f} ms ({b/np.median(v):.0%} of bare)" for k, v in r.items()})
