"""ignis.tools: the product's commands (quickstart, inspect, chat client, test-drafter writer,
setup.sh); benchmarks and GPU-host scripts live in `ignis.tools.bench`."""
