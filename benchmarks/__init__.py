"""The benchmarks: named workloads behind one runner (`python -m benchmarks --list`; benchmarks/run.py).

Their figures, each with its command, are in docs/BENCHMARKS.md (speed, memory, traffic) and docs/EVAL.md
(quality). Nothing here is imported by the library or the programs; importing this package imports nothing.
"""
