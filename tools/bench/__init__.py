"""ignis.tools.bench: benchmarks and GPU-host scripts, run as `python -m ignis.tools.bench.NAME`
(figures in docs/perf/README.md)."""
