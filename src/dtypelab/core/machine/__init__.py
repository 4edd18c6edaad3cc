"""What a machine can do: this machine's probe (``hardware``: its device, matmul rates per dtype, bandwidth, per-op
time, timed by ``rates_probe``), and the models the forecasts compute with for a machine that is not here: the GPUs'
table (``devices``: memory, rates, bandwidth, power, each from its datasheet), the roofline time model of an op and a
step (``speed``) and the power model (``power``). Nothing here runs a model."""
