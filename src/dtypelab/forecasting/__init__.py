"""forecast: each policy's peak memory, traced on fake tensors without running the model, against a GPU you name
(options, run: ``forecast()``; job: the work in a worker; trace: a step on fake tensors; ledger: what is alive;
search: the largest batch that fits). Serving's forecast (``dtypelab.serving``) traces its own workload with the
same ledger, fake tensors and time model: those are public names too."""

from dtypelab.forecasting.energy import Measured, calibrate, read_measured, target_power, with_energy
from dtypelab.forecasting.fake import eager, faked, fresh, materialize
from dtypelab.forecasting.ledger import CUDA_BLOCK, Ledger, Peak
from dtypelab.forecasting.options import ForecastOptions
from dtypelab.forecasting.run import DEFAULT_TRAIN, answer, forecast, target_device
from dtypelab.forecasting.timing import StepTimes, rates_for

__all__ = ["CUDA_BLOCK", "DEFAULT_TRAIN", "ForecastOptions", "Ledger", "Measured", "Peak", "StepTimes", "answer",
           "calibrate", "eager", "faked", "forecast", "fresh", "materialize", "rates_for", "read_measured",
           "target_device", "target_power", "with_energy"]
