"""Benchmarks: `tokenmill bench throughput|latency|serve`, with a roofline report.

Modules, one job each:
  workloads   the standard workloads of BENCHMARKS.md, and custom ones from flags
  roofline    measured device ceilings and the per-step floor (bytes, FLOPs, seconds)
  common      the workload from the flags, the engine from the workload, device sync
  step_timer  host-side timing of each engine step (for per-kind roofline fractions)
  throughput  offline throughput through the LLM API
  hf_peer     the same workload through HF transformers continuous batching
  latency     batch-1 decode latency
  serve       an async load generator against the OpenAI-compatible HTTP server
  plots       PNG figures next to the JSON
  report      run metadata, JSON output, merging and the summary table
  cli         the `bench` subcommand
"""
