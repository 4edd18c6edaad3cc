"""serving: a causal language model generating tokens under each weight and KV-cache format; measured here
(``bench --mode generate``: bench) or forecast for a GPU (``forecast --mode generate``: forecast). kv: the cache's
formats; workload: prefill, decode, quality; served: what can be served; policies: NAME[+kv-FORMAT]; measure: one
policy in a worker."""

from dtypelab.serving.bench import QUALITY_SEQUENCES, calibration_windows, check_shape, serve_bench
from dtypelab.serving.compressed import VLLM_FUSED, export_compressed
from dtypelab.serving.forecast import serve_forecast
from dtypelab.serving.kernels import kernel_of
from dtypelab.serving.kv import FORMATS, bytes_per_token, kv_format
from dtypelab.serving.measure import built
from dtypelab.serving.policies import DEFAULT_FORECAST, DEFAULT_MEASURED, serve_policies, serve_policy
from dtypelab.serving.quality import kl_divergence
from dtypelab.serving.served import load_served
from dtypelab.serving.workload import Shape

__all__ = ["DEFAULT_FORECAST", "DEFAULT_MEASURED", "FORMATS", "QUALITY_SEQUENCES", "VLLM_FUSED", "Shape", "built",
           "bytes_per_token", "calibration_windows", "check_shape", "export_compressed", "kernel_of", "kl_divergence",
           "kv_format", "load_served", "serve_bench", "serve_forecast", "serve_policies", "serve_policy"]
