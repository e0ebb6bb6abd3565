"""`tandem bench`: offline throughput and latency of the engine, side by side with HF
transformers `generate` on the same weights and with the device's roofline.

Entry point: `tandem.bench.cli.run_bench` (wired as the `bench` subcommand of `tandem`).
Nothing here imports the HTTP stack, so it runs where only torch and transformers exist.
"""
