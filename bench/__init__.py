"""qrt's benchmarks, kernel probes and the tools they share, each run as a module from the
repository root: `python -m bench.decode`, `python -m bench.suite --help`."""
