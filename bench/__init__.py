"""qrt's benchmarks, each run as a module from the repository root: `python -m bench.decode`,
`python -m bench.profiles.profile_decode --help`.

- bench/: the benchmarks that say how fast qrt is and what it costs in memory and quality (decode,
  suite with its one-process-per-job engines, startup, context, serve_load, speculative, tp, gpu,
  quality, agreement, load_memory), and what they share: measure (timing, prompts, tables), quants
  (the --quant names), roofline (this machine's bandwidth and the bytes a decode step reads).
- profiles/: where the time or memory of one run goes.
- probes/: kernel and library options timed side by side at fixed shapes, the evidence behind the
  choices the docs record.
- tools/: what the benchmarks use but do not measure: random-weight models, pre-quantized exports,
  llama.cpp's GGUF variants, the suite's chart.
"""
