"""forecast: each policy's peak memory, traced on fake tensors without running the model, against a GPU you name
(options, run: ``forecast()``; job: the work in a worker; trace: a step on fake tensors; ledger: what is alive;
search: the largest batch that fits)."""

from dtypelab.forecasting.options import ForecastOptions
from dtypelab.forecasting.run import DEFAULT_TRAIN, answer, forecast, target_device

__all__ = ["DEFAULT_TRAIN", "ForecastOptions", "answer", "forecast", "target_device"]
