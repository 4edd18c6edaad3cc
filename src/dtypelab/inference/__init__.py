"""Inference: output fidelity vs fp32 (SQNR, cosine), per-layer SQNR, sizes on disk, and export of converted
models (``export``, on ``ExportOptions``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "export": "exporting", "load_exported": "exporting", "read_metadata": "exporting", "ExportInfo": "exporting",
    "ExportOptions": "options", "compare": "fidelity", "compare_outputs": "fidelity", "flat": "fidelity",
    "per_sample": "fidelity", "sqnr_db": "fidelity", "layer_fidelity": "perlayer", "linear_weight_bytes": "sizes",
    "serialize": "sizes", "PTE": "sizes",
})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.inference.exporting import ExportInfo, export, load_exported, read_metadata
    from dtypelab.inference.fidelity import compare, compare_outputs, flat, per_sample, sqnr_db
    from dtypelab.inference.options import ExportOptions
    from dtypelab.inference.perlayer import layer_fidelity
    from dtypelab.inference.sizes import PTE, linear_weight_bytes, serialize
