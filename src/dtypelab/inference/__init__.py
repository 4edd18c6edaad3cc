"""Inference: output fidelity vs fp32 (SQNR, cosine), per-layer SQNR, sizes on disk, and export of converted
models."""

from dtypelab.inference.export import ExportInfo, export, load_exported, read_metadata
from dtypelab.inference.fidelity import compare, flat, per_sample, sqnr_db
from dtypelab.inference.perlayer import layer_fidelity
from dtypelab.inference.sizes import linear_weight_bytes, serialize

compare_outputs = compare

__all__ = ["ExportInfo", "compare", "compare_outputs", "export", "flat", "layer_fidelity", "linear_weight_bytes",
           "load_exported", "per_sample", "read_metadata", "serialize", "sqnr_db"]
