"""Every test runs on the CPU with 8 simulated devices (laplace_jax.platform.simulate_cpu_devices, before JAX's
first use of a device; processes the tests start inherit the count through the environment).

Four things keep the suite's wall time down (tests/run.sh runs it on two pytest-xdist workers, one file at a
time each):
- each worker on its own core (_pin_worker_to_its_cores below);
- unoptimised CPU code generation (FAST_COMPILE below);
- one XLA compilation cache per run, shared by both workers and every subprocess a test starts: the many
  tests that build the same tiny engine or train step compile it once, then read it back;
- files start slowest first (FILE_SECONDS below), so no heavy file is handed out last to one worker while
  the other idles. tests/run.sh passes --no-loadscope-reorder, or xdist would reorder files by test count.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's programs are tiny: XLA's compile time dwarfs their run time, and much of a compile is LLVM
# optimising kernels that then run for microseconds. LLVM at level 1 without its expensive passes, and XLA's
# loop emitters instead of its fusion emitters, cut the backend compile of tiny's train step on 8 devices
# from 4.8 s to 2.6 s (the suite: 10.1 -> 8.3 min); the code runs about as fast and draws the same bits (the
# pinned init values of test_model pass under both). Level 0 compiles faster still, but runs sampling and
# load tests several times slower and rounds the random normals' last bits otherwise. The HLO passes, which
# the traffic and Neuron checks read, are unaffected; the emitters change the optimised HLO's fusions, so
# the tests that read bytes moved from it compile with XLA's own (tests/helpers/hlo_compile.py). Processes the
# tests start inherit the flags; benchmarks and the programs run outside the suite keep XLA's defaults.
FAST_COMPILE = (
  "--xla_backend_optimization_level=1",
  "--xla_llvm_disable_expensive_passes=true",
  "--xla_cpu_use_fusion_emitters=false",
)
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in FAST_COMPILE if f not in _flags])
# The first process to load this file (the xdist controller, or the only one with -n 0) makes the cache
# directory; workers and subprocesses inherit the variable. A new, empty directory each run: nothing
# compiled by an earlier version of the code is ever read. Compiles under 0.2 s are not worth a file.
# The compile counters in the tests still see a cache hit: JAX records backend_compile_duration around
# the cache read too. A read logs "cpu_aot_loader ... +prefer-no-gather is not supported on the host": those
# are tuning hints, not instructions, and the writer was this same machine.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="laplace-jax-test-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  atexit.register(shutil.rmtree, _cache, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


def _pin_worker_to_its_cores():
  """Each xdist worker on its own share of the cores (worker i of n: cores i, i + n, ...). Alone, a test
  process spreads XLA's work over every core and gains little by it (test_model's pattern tests: 36.5 s on
  two cores for 49 CPU-seconds, 39.9 s on one for 40); two workers doing so contend for the same cores.
  Called before JAX starts a thread: its threads, and the processes tests start, inherit the mask."""
  worker, n = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
  if not worker.startswith("gw") or n < 2 or not hasattr(os, "sched_setaffinity"):
    return
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) >= n:
    os.sched_setaffinity(0, cores[int(worker[2:]) % n :: n])


_pin_worker_to_its_cores()

import jax  # noqa: E402

from laplace_jax.platform import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)
jax.config.update("jax_default_matmul_precision", "highest")

# Seconds per file (both workers busy, 2-core machine): the order files are handed out, slowest first.
# Keyed by file name (names are unique across tests/ folders). Files not listed count as 0 and keep their
# collection order after these. Refresh the table from
# `bash tests/run.sh --durations=0` when a file's cost changes by much; the order matters, not the digits.
FILE_SECONDS = {
  "test_train_program.py": 92,
  "test_model.py": 77,
  "test_train_step.py": 74,
  "test_recall_program.py": 66,
  "test_train_resume.py": 58,
  "test_segments.py": 40,
  "test_state_passing.py": 38,
  "test_eval_program.py": 37,
  "test_serve_patterns.py": 33,
  "test_context_parallel.py": 33,
  "test_serve_state_cache.py": 31,
  "test_scan_layers.py": 28,
  "test_serve_verify.py": 40,
  "test_serve_engine.py": 24,
  "test_gla_decode.py": 21,
  "test_gla.py": 21,
  "test_muon.py": 20,
  "test_sampling_mask.py": 20,
  "test_serve_restart.py": 20,
  "test_serve_constrained.py": 20,
  "test_serve_export.py": 19,
  "test_speculative.py": 18,
  "test_neuron_target.py": 18,
  "test_long_context.py": 16,
  "test_serve_load.py": 14,
  "test_optimizer.py": 14,
  "test_checkpoint.py": 14,
  "test_state.py": 11,
  "test_attention.py": 11,
  "test_serve_responses.py": 10,
  "test_fsdp.py": 9,
  "test_grammar.py": 8,
  "test_generate.py": 9,
  "test_window_attention.py": 8,
  "test_serve_logprobs.py": 8,
  "test_sampling_branch_free.py": 8,
  "test_slot_writes.py": 30,
  "test_hf_export.py": 12,
  "test_loss_by_position.py": 7,
  "test_sampling_prng.py": 5,
}


def pytest_collection_modifyitems(items):
  """Slowest files first (a stable sort: tests keep their order inside a file)."""
  items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
