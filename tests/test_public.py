"""What registers itself: record kinds (by their schema), their renderers (page section, terminal document), the CLI's
commands (one module each), and the public names (one list)."""

from __future__ import annotations

import ast
import os
import pkgutil

import dtypelab
from dtypelab.core.results import KINDS, Record, Report


def test_every_record_kind_is_registered_by_its_schema_and_drawn():
    from dtypelab.render.drawing import document_of, section_of

    assert {cls.__name__ for cls in KINDS.values()} == {
        "Report", "AuditReport", "TraceReport", "LintReport", "TuneReport", "AutopilotReport", "ForecastReport",
        "GenerateReport", "GeneratePlanReport"}
    for schema, cls in KINDS.items():
        assert cls.schema == schema and issubclass(cls, Record)
        section_of(object.__new__(cls))  # a page section for every kind
        if cls not in (Report, KINDS["dtypelab.lint"]):  # bench and lint print their own tables
            assert document_of(object.__new__(cls)) is not None, cls


def test_every_cli_module_registers_its_commands():
    import dtypelab.cli as cli

    names = {c.name or c.callback.__name__ for c in cli.app.registered_commands}
    modules = [m.name for m in pkgutil.iter_modules(cli.__path__) if not m.name.startswith("_")]
    assert {"bench", "tune", "autopilot", "show", "report", "audit", "trace", "export", "lint", "forecast"} <= names
    assert set(modules) == {"autopilot", "bench", "diagnose", "export", "forecast", "numeric", "tune"}


def test_the_public_names_are_one_list_and_the_type_checking_imports_agree():
    with open(os.path.join(os.path.dirname(dtypelab.__file__), "__init__.py")) as f:
        tree = ast.parse(f.read())
    checking = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    imported = {a.asname or a.name for n in checking.body for a in n.names}
    assert imported == set(dtypelab.__all__) - {"__version__"}
    assert set(dir(dtypelab)) >= set(dtypelab.__all__)


def test_every_packages_lazy_public_names_resolve():
    """A package's public names are loaded on first use from a table of module names (``core.lazy.exports``): each
    must name a module that exists and holds it, or the first caller fails (a renamed module did)."""
    import importlib

    import dtypelab

    packages = [m.name for m in pkgutil.walk_packages(dtypelab.__path__, "dtypelab.") if m.ispkg]
    checked = 0
    for name in packages:
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):
            assert getattr(module, public) is not None, f"{name}.{public}"
            checked += 1
    assert checked > 200 and "dtypelab.script" in packages


def test_a_required_option_is_required_on_the_command_line():
    """export's --policy and --output once showed [default: PydanticUndefined] and failed later, confusingly."""
    import inspect

    from dtypelab.cli._options import option_params
    from dtypelab.inference.options import ExportOptions

    params = {p.name: p for p in option_params(ExportOptions)}
    assert params["output"].default is inspect.Parameter.empty and params["policy"].default is inspect.Parameter.empty
    assert params["seed"].default is not inspect.Parameter.empty
    samples = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "samples")
    for name in os.listdir(samples):
        with open(os.path.join(samples, name)) as f:
            assert "PydanticUndefined" not in f.read(), name
