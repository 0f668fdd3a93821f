"""ignis.compiler.kernels: hand-written kernels built into per-card modules (q4_g32 linear)."""
