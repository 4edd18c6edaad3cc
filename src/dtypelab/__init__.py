"""dtypelab: measure which numeric precision your PyTorch model should use, on your own hardware.

The public names below load on first use (``dtypelab.bench`` imports the sweep and torch; ``import dtypelab``
alone imports neither), each from its package's public API. ``dtypelab.lightning`` and ``dtypelab.hf`` are the
Lightning and Hugging Face integrations (optional extras).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dtypelab.core.version import __version__

# public name -> the module that defines it publicly
_PUBLIC = {
    # measuring (capabilities)
    "bench": "dtypelab.sweep", "autopilot": "dtypelab.piloting", "tune": "dtypelab.tuning",
    "apply_plan": "dtypelab.tuning",
    "forecast": "dtypelab.forecasting", "ForecastOptions": "dtypelab.forecasting",
    "serve_bench": "dtypelab.serving", "serve_forecast": "dtypelab.serving", "Shape": "dtypelab.serving",
    "trace": "dtypelab.tracing", "watch": "dtypelab.tracing", "Guard": "dtypelab.tracing",
    "NonFiniteError": "dtypelab.tracing", "profile": "dtypelab.profiling", "audit": "dtypelab.numerics",
    "analyze_values": "dtypelab.numerics", "cast_file": "dtypelab.numerics", "cast_report": "dtypelab.numerics",
    "Format": "dtypelab.numerics", "formats": "dtypelab.numerics", "get_format": "dtypelab.numerics",
    "RangeStats": "dtypelab.numerics", "range_stats": "dtypelab.numerics", "export": "dtypelab.inference",
    "load_exported": "dtypelab.inference", "ExportInfo": "dtypelab.inference",
    "compare_outputs": "dtypelab.inference", "lint_paths": "dtypelab.lint", "lint_source": "dtypelab.lint",
    "session": "dtypelab.piloting", "Session": "dtypelab.script", "report": "dtypelab.render",
    "ReportInfo": "dtypelab.render",
    # the core: tasks, hardware, policies and plans, judging, records
    "Task": "dtypelab.core.task", "InferenceTask": "dtypelab.core.task", "load_task": "dtypelab.core.task",
    "DtypelabError": "dtypelab.core.errors", "TaskError": "dtypelab.core.errors",
    "HardwareInfo": "dtypelab.core.machine.hardware", "probe": "dtypelab.core.machine.hardware",
    "TF32": "dtypelab.core.policies", "Autocast": "dtypelab.core.policies", "Cast": "dtypelab.core.policies",
    "Config": "dtypelab.core.policies", "Facts": "dtypelab.core.policies", "Plan": "dtypelab.core.policies",
    "ActivationPart": "dtypelab.core.policies",
    "Precision": "dtypelab.core.policies",
    "Quantize": "dtypelab.core.policies", "get_policy": "dtypelab.core.policies",
    "load_plan": "dtypelab.core.policies", "register": "dtypelab.core.policies",
    "Tolerance": "dtypelab.core.judging", "Recommendation": "dtypelab.core.judging",
    "recommend": "dtypelab.core.judging",
    "AuditReport": "dtypelab.core.results", "AutopilotReport": "dtypelab.core.results",
    "Finding": "dtypelab.core.results",
    "LintFinding": "dtypelab.core.results", "LintReport": "dtypelab.core.results",
    "PolicyResult": "dtypelab.core.results", "ProfileSummary": "dtypelab.core.results",
    "Report": "dtypelab.core.results", "RunConfig": "dtypelab.core.results", "TraceReport": "dtypelab.core.results",
    "TuneReport": "dtypelab.core.results", "ForecastReport": "dtypelab.core.results",
    "GenerateReport": "dtypelab.core.results",
    "load_record": "dtypelab.core.records",
    "load_report": "dtypelab.core.records", "Float8Train": "dtypelab.core.policies",
}
_INTEGRATIONS = ("lightning", "hf")

# the one list: __all__, dir() and the loader below are made from it (a test checks the TYPE_CHECKING imports agree)
__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.core.errors import DtypelabError, TaskError
    from dtypelab.core.judging import Recommendation, Tolerance, recommend
    from dtypelab.core.machine.hardware import HardwareInfo, probe
    from dtypelab.core.policies import (
        TF32,
        ActivationPart,
        Autocast,
        Cast,
        Config,
        Facts,
        Float8Train,
        Plan,
        Precision,
        Quantize,
        get_policy,
        load_plan,
    )
    from dtypelab.core.policies import register as register
    from dtypelab.core.records import load_record, load_report
    from dtypelab.core.results import (
        AuditReport,
        AutopilotReport,
        Finding,
        ForecastReport,
        GenerateReport,
        LintFinding,
        LintReport,
        PolicyResult,
        ProfileSummary,
        Report,
        RunConfig,
        TraceReport,
        TuneReport,
    )
    from dtypelab.core.task import InferenceTask, Task, load_task
    from dtypelab.forecasting import ForecastOptions, forecast
    from dtypelab.inference import ExportInfo, compare_outputs, export, load_exported
    from dtypelab.lint import lint_paths, lint_source
    from dtypelab.numerics import (
        Format,
        RangeStats,
        analyze_values,
        audit,
        cast_file,
        cast_report,
        formats,
        get_format,
        range_stats,
    )
    from dtypelab.piloting import autopilot, session
    from dtypelab.profiling import profile
    from dtypelab.render import ReportInfo, report
    from dtypelab.script import Session
    from dtypelab.serving import Shape, serve_bench, serve_forecast
    from dtypelab.sweep import bench
    from dtypelab.tracing import Guard, NonFiniteError, trace, watch
    from dtypelab.tuning import apply_plan, tune


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # once loaded, a plain attribute
        return value
    if name in _INTEGRATIONS:  # Lightning and transformers are optional extras
        return importlib.import_module(f"dtypelab.{name}")
    raise AttributeError(f"module 'dtypelab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*__all__, *_INTEGRATIONS]
