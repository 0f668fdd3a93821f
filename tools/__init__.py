"""ignis.tools: benchmarks, inspect, the client, test-drafter writers."""
