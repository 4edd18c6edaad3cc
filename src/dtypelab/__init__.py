"""dtypelab: measure which numeric precision your PyTorch model should use, on your own hardware."""

__version__ = "0.1.0"

from .bench import bench  # noqa: E402
from .errors import DtypelabError, TaskError  # noqa: E402
from .hardware import HardwareInfo, probe  # noqa: E402
from .recommend import Recommendation, Tolerance, recommend  # noqa: E402
from .results import PolicyResult, Report, RunConfig, load_report  # noqa: E402
from .task import Task, load_task  # noqa: E402

__all__ = [
    "DtypelabError", "HardwareInfo", "PolicyResult", "Recommendation", "Report", "RunConfig", "Task",
    "TaskError", "Tolerance", "__version__", "bench", "load_report", "load_task", "probe", "recommend",
]
