"""`ignis-bench`: a load generator for a running server (Unix socket or TCP), like `vllm bench serve`.

- `workload`: prompts from JSONL, seeded random token-id prompts, synthetic agent sessions;
- `client`: one streamed request timed client-side (httpx), /metrics and /v1/models;
- `run`: Poisson arrivals under a concurrency limit, and the `--multi-turn` agent replay;
- `stats`: percentiles, summaries, /metrics deltas (tokens per round, acceptance by position);
- `report`: the text table; `cli`: the console script.
"""
