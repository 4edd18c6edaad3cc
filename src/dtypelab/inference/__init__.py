"""inference: output fidelity vs fp32, per-layer SQNR, sizes on disk, and export of converted models."""
