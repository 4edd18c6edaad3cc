from __future__ import annotations

import pytest
import torch

from dtypelab.core.measure import MemoryMeter, StepTimer
from dtypelab.core.stats import summarize
from dtypelab.inference.sizes import model_bytes


class FakeClock:
    def __init__(self, times):
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


def test_step_timer_uses_injected_clock_and_sync():
    synced = []
    timer = StepTimer(clock=FakeClock([0.0, 0.5, 1.0, 1.25, 10.0, 13.0]), sync=lambda: synced.append(1))
    for _ in range(3):
        timer.start()
        timer.stop()
    assert timer.samples == [0.5, 0.25, 3.0]
    assert len(synced) == 6  # before every clock read: device work lands in the step that issued it


def test_stop_without_start_is_an_error():
    with pytest.raises(RuntimeError):
        StepTimer(clock=FakeClock([0.0])).stop()


def test_summary_median_iqr_and_noise_flag():
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s.median, s.q1, s.q3, s.iqr) == (3.0, 2.0, 4.0, 2.0)
    assert s.noisy  # IQR/median 0.67 > 0.10
    steady = summarize([1.0, 1.01, 0.99, 1.0, 1.02])
    assert not steady.noisy
    assert summarize([]) is None


def test_summary_is_robust_to_one_outlier():
    s = summarize([1.0] * 20 + [100.0])
    assert s.median == 1.0 and not s.noisy


def test_memory_meter_sees_a_large_allocation():
    meter = MemoryMeter(torch.device("cpu"))
    meter.start()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    peak = meter.peak_bytes()
    del block
    assert 60 * 2**20 <= peak <= 200 * 2**20, peak
    assert "baseline" in meter.method


def test_model_bytes_counts_dtype_and_shared_tensors_once():
    lin = torch.nn.Linear(100, 100)
    fp32 = model_bytes(lin)
    assert 40_400 <= fp32 <= 40_400 + 1024  # payload + safetensors header
    assert model_bytes(lin.to(torch.bfloat16)) < fp32 * 0.55
    tied = torch.nn.Sequential(torch.nn.Embedding(50, 100), torch.nn.Linear(100, 50, bias=False))
    tied[1].weight = tied[0].weight
    assert model_bytes(tied) < 50 * 100 * 4 + 1024


def test_cpu_meter_counts_other_processes_from_injected_readings():
    from dtypelab.core.disturbance import CpuMeter, CpuReading

    readings = iter([CpuReading(100.0, 500.0, 10.0, 1.0, 20.0, 5), CpuReading(110.0, 528.0, 28.0, 1.5, 24.0, 9)])
    meter = CpuMeter(read=lambda: next(readings), resolution_s=0.0)
    meter.start()
    d = meter.stop()
    # machine-wide busy +28 s, ours +18 s: others used 10 s of CPU in 10 s, one core's worth
    assert (d.wall_s, d.other_cpu_s, d.other_cores, d.steal_s, d.pressure_s, d.involuntary_switches) == (
        10.0, 10.0, 1.0, 0.5, 4.0, 4)
    assert d.disturbed


def test_cpu_meter_sees_a_real_busy_process():
    import subprocess
    import sys
    import time

    from dtypelab.core.disturbance import CpuMeter

    quiet = CpuMeter()
    quiet.start()
    time.sleep(0.3)
    calm = quiet.stop()
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.5)  # let it start
        meter = CpuMeter()
        meter.start()
        time.sleep(1.0)
        busy = meter.stop()
    finally:
        burner.wait()
    assert busy.other_cores > 0.5 and busy.disturbed, busy  # one process spinning: about one core
    assert calm is not None and calm.wall_s > 0.25


def test_a_broken_reader_leaves_the_run_measured_without_context():
    from dtypelab.core.disturbance import CpuMeter

    def boom():
        raise OSError("no /proc here")

    meter = CpuMeter(read=boom)
    meter.start()
    assert meter.stop() is None


def test_a_tick_of_rounding_in_a_short_block_is_not_another_process():
    """A quiet machine was once called busy: over a 37 ms block of timed steps, machine-wide CPU time (10 ms ticks)
    read one tick more than this process's own, 0.27 of a core. The counters' resolution is discounted, and a short
    window is judged by whether tasks waited for a CPU."""
    from dtypelab.core.disturbance import CpuMeter, CpuReading

    def meter(*readings: CpuReading) -> CpuMeter:
        it = iter(readings)
        m = CpuMeter(read=lambda: next(it), resolution_s=0.03)
        m.start()
        return m

    tick = meter(CpuReading(10.0, 500.00, 20.00, 0.0, 5.0, 0), CpuReading(10.037, 500.08, 20.07, 0.0, 5.001, 0)).stop()
    assert tick.raw_other_cpu_s == pytest.approx(0.01) and tick.other_cpu_s == 0.0 and not tick.disturbed
    # a real competitor in the same short window: its CPU time is near the resolution, but our threads waited
    hog = meter(CpuReading(10.0, 500.00, 20.00, 0.0, 5.0, 0), CpuReading(10.037, 500.10, 20.07, 0.0, 5.033, 9)).stop()
    assert hog.other_cores < 0.25 and hog.stalled > 0.5 and hog.disturbed
    assert hog.to_dict()["disturbed"] is True and tick.to_dict()["disturbed"] is False


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_measured_run_leaves_what_was_alive_out_of_its_collections_and_collects_its_own_garbage():
    import gc
    import weakref

    from dtypelab.core.measure import release_free_memory, young_heap

    before = _Cycle()
    gone_before = weakref.ref(before)
    del before  # cyclic garbage from before the run: frozen with the rest, not the run's to collect
    with young_heap():
        assert gc.get_freeze_count() > 0
        mine = _Cycle()
        gone_mine = weakref.ref(mine)
        del mine
        release_free_memory()  # a window's collection walks the run's own objects
        assert gone_mine() is None and gone_before() is not None
        left = _Cycle()
        left_ref = weakref.ref(left)
        del left
    assert left_ref() is None  # the run's garbage is collected on the way out
    assert gc.get_freeze_count() == 0  # and the collector is as it was
    gc.collect()
    assert gone_before() is None


def test_a_freeze_already_in_place_is_left_as_it_is():
    import gc

    from dtypelab.core.measure import young_heap

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with young_heap():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
