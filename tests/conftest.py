from __future__ import annotations

import os
import sys

import pytest
import torch

from dtypelab.core.machine.hardware import HardwareInfo

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny_task.py")
sys.path.insert(0, HERE)


def fake_hardware(fp16_gflops: float = 0.5, device: str = "cpu", **kernels: float) -> HardwareInfo:
    """A CPU like the build machines: fast bf16, no native fp16. Skips the ~1 s probe in tests. ``kernels``:
    quantized kernels' GFLOP/s by probe key (``int8=2.0``; dashes as underscores)."""
    gflops = {"float64": 40.0, "float32": 100.0, "bfloat16": 250.0, "float16": fp16_gflops}
    gflops.update({k.replace("_", "-"): v for k, v in kernels.items()})
    return HardwareInfo(device=device, device_name="test cpu", cpu_name="test cpu",
                        cpu_flags=("avx512f", "avx512_bf16"), cpu_capability="AVX512",
                        cuda_capability=None, threads=torch.get_num_threads(), gflops=gflops)


def avx2_hardware() -> HardwareInfo:
    """The 2-core AVX2-only EPYC as `dtypelab hardware` measured it: bf16 and fp16 ~118x slower than fp32 (no native
    arithmetic), torchao's int8 matmul 27x slower (no VNNI), fbgemm's int8 faster."""
    gflops = {"float64": 66.8, "float32": 166.0, "bfloat16": 1.4, "float16": 1.42, "int8": 6.11,
              "int8-fbgemm": 226.0, "int8-weight-only": 138.0, "fp8-weight-only": 89.2}
    return HardwareInfo(device="cpu", device_name="AMD EPYC", cpu_name="AMD EPYC", cpu_flags=("avx2", "fma", "f16c"),
                        cpu_capability="AVX2", cuda_capability=None, threads=torch.get_num_threads(), gflops=gflops)


def hardware_file(directory, hw: HardwareInfo | None = None) -> str:
    """A saved probe (as `dtypelab hardware --json` writes it) for --hardware / DTYPELAB_HARDWARE."""
    from dtypelab.core.results import plain_json

    path = os.path.join(str(directory), "hardware.json")
    with open(path, "w") as f:
        f.write(plain_json((hw or fake_hardware()).to_dict()))
    return path


def started_with(token: str) -> set[int]:
    """Live processes started with ``LEAK_PROBE=token`` in their environment, fresh or forked from a zygote started
    with it: this test's own, not those of a test running beside it (pytest -n)."""
    out = set()
    for p in filter(lambda p: p.isdigit() and int(p) != os.getpid(), os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                mine = f"LEAK_PROBE={token}".encode() in f.read().split(b"\0")
            with open(f"/proc/{p}/stat") as f:
                if mine and f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(int(p))
        except (OSError, IndexError):
            continue
    return out


def interruptible() -> None:
    """A ``preexec_fn`` for a child a test will send SIGINT: SIGINT at its default, so that Python installs its
    KeyboardInterrupt handler there even when the suite itself was started with SIGINT ignored (``bash .ci/run &`` from
    a script, as many CI runners start it), a disposition every child would otherwise inherit."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def with_project_hooks(tests, *hooks: str) -> None:
    """A conftest.py in the folder ``tests`` that takes ``hooks`` from this one, loaded under another name (two
    modules called conftest would clash): a pytest run there uses the project's own hooks."""
    tests.mkdir(exist_ok=True)
    (tests / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('project_conftest', {os.path.join(HERE, 'conftest.py')!r})\n"
        "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n"
        + "".join(f"{hook} = module.{hook}\n" for hook in hooks))


def made_once(tmp_path_factory, name: str, make) -> str:
    """The path of ``name``, made by ``make(path)`` once per test session: under pytest -n the first worker to ask
    makes it while the others wait on a lock, then read it (a module fixture would be run by each worker that
    runs one of its tests)."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' folders are siblings
    path = shared / name
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            make(str(path))
    return str(path)


@pytest.fixture
def hw() -> HardwareInfo:
    return fake_hardware()


@pytest.fixture(scope="session")
def fast_bf16_env(tmp_path_factory) -> dict[str, str]:
    """The environment for a CLI subprocess that needs bf16 (or int8) to run whatever this CPU is: the commands
    decide with fake_hardware()'s figures instead of probing (DTYPELAB_HARDWARE). The refusals themselves are
    tested with avx2_hardware()."""
    return {**os.environ, "DTYPELAB_HARDWARE": hardware_file(tmp_path_factory.mktemp("hw"),
                                                              fake_hardware(int8=250.0)), "COLUMNS": "200"}


@pytest.fixture
def tiny() -> str:
    return f"{TINY}:make_task"


def passed_last(items: list, path: str) -> list:
    """The items whose node ID the file at PATH lists (one per line) moved to the end, each group in its order."""
    with open(path) as f:
        done = {line.strip() for line in f if line.strip()}
    return [i for i in items if i.nodeid not in done] + [i for i in items if i.nodeid in done]


def pytest_collection_modifyitems(config, items):
    passed_before = os.environ.get("DTYPELAB_PASSED_BEFORE")
    if passed_before:  # scripts/gpu/check: a loan too short for every cuda test runs first those none has passed
        items[:] = passed_last(items, passed_before)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# each worker holds torch, transformers and a model or two (1.1 GB at its peak; the whole suite's processes 5.3 GB
# together with two workers, measured), and the suite's machines have 24 GB
MAX_WORKERS = 4


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by a cgroup's CPU quota (a container's --cpus), which
    psutil's count of the host's cores does not see."""
    n = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`pytest -n auto` (the README's test command): a worker per usable CPU, at most MAX_WORKERS."""
    return max(1, min(usable_cpus(), MAX_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller: its terminal's settings for each worker, which would otherwise see COLUMNS=80."""
    node.workerinput["dtypelab_terminal"] = {k: os.environ.get(k) for k in ("COLUMNS", "LINES")}


def pytest_configure(config):
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    for key, value in worker.get("dtypelab_terminal", {}).items():  # the commands tests run read the real width
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    # one core a worker: two workers' OpenMP threads on one core would spin against each other
    per = str(max(1, usable_cpus() // int(worker["workercount"])))
    os.environ.update(OMP_NUM_THREADS=per, MKL_NUM_THREADS=per)
    torch.set_num_threads(int(per))
