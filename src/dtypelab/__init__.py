"""dtypelab: measure which numeric precision your PyTorch model should use, on your own hardware."""

__version__ = "0.1.0"

from dtypelab.bench.recommend import Recommendation, Tolerance, recommend
from dtypelab.bench.sweep import bench
from dtypelab.core.errors import DtypelabError, TaskError
from dtypelab.core.hardware import HardwareInfo, probe
from dtypelab.core.policies import (
    TF32,
    Autocast,
    Cast,
    Config,
    Plan,
    Precision,
    Quantize,
    get_policy,
    load_plan,
    register,
)
from dtypelab.core.results import (
    AuditReport,
    Finding,
    LintFinding,
    LintReport,
    PolicyResult,
    ProfileSummary,
    Report,
    RunConfig,
    TraceReport,
    load_record,
    load_report,
)
from dtypelab.core.task import InferenceTask, Task, load_task
from dtypelab.inference.export import ExportInfo, export, load_exported
from dtypelab.inference.fidelity import compare as compare_outputs
from dtypelab.lint import lint_paths, lint_source
from dtypelab.numerics.audit import audit
from dtypelab.numerics.castcheck import analyze_values, cast_file, cast_report
from dtypelab.numerics.formats import Format, formats, get_format
from dtypelab.numerics.rangestats import RangeStats, range_stats
from dtypelab.profile import profile
from dtypelab.render.report import ReportInfo, report
from dtypelab.script.session import Session, session
from dtypelab.trace.guard import Guard, NonFiniteError, watch
from dtypelab.trace.run import trace
from dtypelab.tune import apply_plan, tune

__all__ = [
    "TF32",
    "AuditReport",
    "Autocast",
    "Cast",
    "Config",
    "DtypelabError",
    "ExportInfo",
    "Finding",
    "Format",
    "Guard",
    "HardwareInfo",
    "InferenceTask",
    "LintFinding",
    "LintReport",
    "NonFiniteError",
    "Plan",
    "PolicyResult",
    "Precision",
    "ProfileSummary",
    "Quantize",
    "RangeStats",
    "Recommendation",
    "Report",
    "ReportInfo",
    "RunConfig",
    "Session",
    "Task",
    "TaskError",
    "Tolerance",
    "TraceReport",
    "__version__",
    "analyze_values",
    "apply_plan",
    "audit",
    "bench",
    "cast_file",
    "cast_report",
    "compare_outputs",
    "export",
    "formats",
    "get_format",
    "get_policy",
    "lint_paths",
    "lint_source",
    "load_exported",
    "load_plan",
    "load_record",
    "load_report",
    "load_task",
    "probe",
    "profile",
    "range_stats",
    "recommend",
    "register",
    "report",
    "session",
    "trace",
    "tune",
    "watch"
]


def __getattr__(name: str) -> object:
    """``dtypelab.lightning`` and ``dtypelab.hf`` load on first use: Lightning and transformers are optional."""
    if name in ("lightning", "hf"):
        import importlib

        return importlib.import_module(f"dtypelab.{name}")
    raise AttributeError(f"module 'dtypelab' has no attribute {name!r}")
