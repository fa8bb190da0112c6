"""One runner over the named benchmark workloads.

    python -m benchmarks --list                  # every workload, what it measures, its module
    python -m benchmarks NAME [ARGS ...]         # run one (= python -m benchmarks.run NAME [ARGS ...])
    python -m benchmarks NAME --help             # its own options

A workload is a module of this package run as a program, with the arguments given after its name (a
workload of a module with several modes adds its mode first). Commands run from the repository root.
Figures and the commands that produced them: docs/BENCHMARKS.md and docs/EVAL.md.
"""

from __future__ import annotations

import dataclasses
import runpy
import sys


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  module: str  # benchmarks.<module>
  what: str
  args: tuple[str, ...] = ()  # put before the caller's arguments (a mode of a module with several)


_ALL = [
  # training
  Workload("gla_speed", "gla_speed", "chunked simple GLA against the token scan and softmax attention"),
  Workload("train_throughput", "train_throughput", "the compiled train step: tokens/s, MFU, Muon's share"),
  Workload("long_context", "long_context", "train-step memory and time per token at growing lengths"),
  Workload(
    "fsdp_traffic", "compile_proof", "FSDP collectives of the compiled step against the floor", ("fsdp",)
  ),
  Workload("muon_traffic", "compile_proof", "Muon's update alone: two all_to_alls against gather", ("muon",)),
  Workload(
    "train_compile",
    "compile_proof",
    "the step's memory and traffic per Muon distribution",
    ("distributions",),
  ),
  Workload(
    "context_parallel_compile",
    "compile_proof",
    "rows split over a context axis: memory, traffic",
    ("context",),
  ),
  Workload("segment_cost", "step_cost", "step time with and without segment ids", ("--variant", "segments")),
  Workload(
    "state_passing_cost",
    "step_cost",
    "step time with and without state passing",
    ("--variant", "state_passing"),
  ),
  Workload("packed_documents", "packed_documents", "tiny trained with documents apart and as one stream"),
  Workload("long_context_figures", "long_context_figures", "docs/eval/long-context.json from result files"),
  Workload("neuron_roofline", "neuron_roofline", "laplace-3b's roofline on a trn2.48xlarge from the counts"),
  # decode and serving
  Workload("decode_bytes", "decode_bytes", "bytes the compiled decode step moves against its minimum"),
  Workload("gla_decode_speed", "gla_decode_speed", "one GLA layer's decode update against the memory floor"),
  Workload("hybrid_decode", "hybrid_decode", "decode step of G, GGGS and GGGA by slots and context"),
  Workload("state_density", "state_density", "serving memory per sequence by mixer pattern and context"),
  Workload("speculative_model", "speculative_model", "verify of k drafts against one decode step"),
  Workload("speculative_serve", "speculative_serve", "speculative decoding through the engine"),
  Workload("serve_bench", "serve_bench", "serving throughput, context, memory, FLOP/s, engine, state cache"),
  Workload("grammar_masks", "grammar_masks", "grammar libraries' mask cost per token and compile per schema"),
  Workload("hf_export_memory", "hf_export_memory", "peak memory of the Hugging Face export and import"),
  Workload("occupancy", "occupancy", "time and bytes per step by live requests against the slot table"),
  Workload("sampling_cost", "sampling_cost", "time per token of each sampling setting against greedy"),
  Workload(
    "constrained_cost", "constrained_cost", "time per token of constrained requests against free ones"
  ),
  # clients and robustness (the openai ones run from a venv that has `openai`)
  Workload("conversations", "conversations", "20-turn conversations through the openai client"),
  Workload("openai_chat_check", "openai_chat_check", "the openai client's chat calls against a server"),
  Workload("openai_responses_check", "openai_responses_check", "the openai client's Responses API"),
  Workload(
    "openai_tools_check", "openai_tools_check", "structured outputs and tool calls through the openai client"
  ),
  Workload(
    "serve_robust_check", "serve_robust_check", "requests that could stop, freeze or flood the server"
  ),
  Workload("lm_eval_compare", "lm_eval_compare", "lm-eval's loglikelihoods against model.forward"),
]
WORKLOADS = {w.name: w for w in _ALL}


def run(name: str, argv: list[str]) -> None:
  """Run workload `name` with `argv` as its command line, as `python -m benchmarks.<module>` would."""
  if name not in WORKLOADS:
    raise SystemExit(f"benchmarks: no workload {name!r}; `python -m benchmarks --list` names them.")
  w = WORKLOADS[name]
  sys.argv = [f"benchmarks {name}", *w.args, *argv]
  runpy.run_module(f"benchmarks.{w.module}", run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__)
    return
  if argv[0] == "--list":
    width = max(len(n) for n in WORKLOADS)
    for w in _ALL:
      mode = " ".join(w.args)
      print(f"{w.name:<{width}}  {w.what}  [benchmarks.{w.module}{' ' + mode if mode else ''}]")
    return
  run(argv[0], argv[1:])


if __name__ == "__main__":
  main()
