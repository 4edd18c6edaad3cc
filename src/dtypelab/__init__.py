"""dtypelab: measure which numeric precision your PyTorch model should use, on your own hardware."""

__version__ = "0.1.0"

from .bench import bench
from .errors import DtypelabError, TaskError
from .hardware import HardwareInfo, probe
from .recommend import Recommendation, Tolerance, recommend
from .results import PolicyResult, Report, RunConfig, load_report
from .task import Task, load_task

__all__ = [
    "DtypelabError", "HardwareInfo", "PolicyResult", "Recommendation", "Report", "RunConfig", "Task",
    "TaskError", "Tolerance", "__version__", "bench", "load_report", "load_task", "probe", "recommend",
]
