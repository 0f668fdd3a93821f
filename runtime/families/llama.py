"""llama and qwen2 families (to be written: issue 3)."""
