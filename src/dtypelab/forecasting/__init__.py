"""forecast: each policy's peak memory, traced on fake tensors without running the model, against a GPU you name
(options, run: ``forecast()``; job: the work in a worker; trace: a step on fake tensors; ledger: what is alive;
search: the largest batch that fits). Serving's forecast (``dtypelab.serving``) traces its own workload with the
same ledger, fake tensors, time model, depth read-off (``read_off``, ``along``), fits search (``largest_batch``),
tracing workers (``run_parts``, ``worker_count``) and stored weight bytes (``STORED_WEIGHT_BYTES``, ``layout_bytes``):
one of each mechanism, public names too."""

from dtypelab.forecasting.adapters import STORED_WEIGHT_BYTES
from dtypelab.forecasting.depth import along, read_off, shallow_depths
from dtypelab.forecasting.energy import Measured, calibrate, read_measured, target_power, with_energy
from dtypelab.forecasting.fake import eager, faked, fresh, materialize
from dtypelab.forecasting.layouts import layout_bytes
from dtypelab.forecasting.ledger import CUDA_BLOCK, Ledger, Peak
from dtypelab.forecasting.options import ForecastOptions
from dtypelab.forecasting.pool import run_parts, worker_count
from dtypelab.forecasting.run import DEFAULT_TRAIN, INTERRUPTED, answer, forecast, target_device
from dtypelab.forecasting.search import largest_batch
from dtypelab.forecasting.timing import StepTimes, rates_for

__all__ = ["CUDA_BLOCK", "DEFAULT_TRAIN", "INTERRUPTED", "STORED_WEIGHT_BYTES", "ForecastOptions", "Ledger", "Measured",
           "Peak", "StepTimes", "along", "answer", "calibrate", "eager", "faked", "forecast", "fresh", "largest_batch",
           "layout_bytes", "materialize", "rates_for", "read_off", "read_measured", "run_parts", "shallow_depths",
           "target_device", "target_power", "with_energy", "worker_count"]
