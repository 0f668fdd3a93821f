"""qwen3_5, qwen3_5_moe and qwen3_next hybrid families (to be written: issue 3)."""
