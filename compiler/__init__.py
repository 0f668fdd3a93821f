"""ignis.compiler: checkpoint import, family configs, quantization, grafting, TVM codegen, manifest."""
