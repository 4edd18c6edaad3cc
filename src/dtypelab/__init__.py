"""dtypelab: measure which numeric precision your PyTorch model should use, on your own hardware."""

__version__ = "0.1.0"

from .audit import audit
from .bench import bench
from .castcheck import analyze_values, cast_file, cast_report
from .errors import DtypelabError, TaskError
from .export import ExportInfo, export, load_exported
from .fidelity import compare as compare_outputs
from .formats import Format, formats, get_format
from .guard import Guard, NonFiniteError, watch
from .hardware import HardwareInfo, probe
from .lint import lint_paths, lint_source
from .rangestats import RangeStats, range_stats
from .recommend import Recommendation, Tolerance, recommend
from .results import (
                      AuditReport,
                      Finding,
                      LintFinding,
                      LintReport,
                      PolicyResult,
                      Report,
                      RunConfig,
                      TraceReport,
                      load_record,
                      load_report,
)
from .task import Task, load_task
from .trace import trace

__all__ = [
    "AuditReport", "DtypelabError", "ExportInfo", "Finding", "Format", "Guard", "HardwareInfo", "LintFinding",
    "LintReport", "NonFiniteError", "PolicyResult", "RangeStats", "Recommendation", "Report", "RunConfig", "Task",
    "TaskError", "Tolerance", "TraceReport", "__version__", "analyze_values", "audit", "bench", "cast_file",
    "cast_report", "compare_outputs", "export", "formats", "get_format", "lint_paths", "lint_source",
    "load_exported", "load_record", "load_report", "load_task", "probe", "range_stats", "recommend", "trace",
    "watch"
]
