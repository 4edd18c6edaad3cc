"""The HTML report: one offline page from any records, checked as text and in a real browser."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from conftest import TINY, fake_hardware

import dtypelab
from dtypelab.core.records import load_record
from dtypelab.render.page import report, report_html
from dtypelab.render.plots import pareto

ROOT = os.path.join(os.path.dirname(__file__), "..")
V1 = os.path.join(os.path.dirname(__file__), "data", "v1")
ARTIFACTS = os.path.join(ROOT, "test-artifacts", "report")  # screenshots, kept by CI
# Anything that would make the page fetch something: a src or href to a URL, a stylesheet link, CSS imports and
# url()s, fonts. (SVG's xmlns="http://www.w3.org/2000/svg" is a name, never fetched.)
FETCHES = re.compile(r"""(\s(src|href)\s*=\s*["']?\s*(https?:|//))|<link\b|@import|url\(\s*["']?(https?:|//)"""
                     r"|@font-face", re.I)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Fresh records of the tiny task (training with GradScaler, inference with per-layer SQNR) and the v1 files."""
    tmp = tmp_path_factory.mktemp("records")
    hw = fake_hardware()
    train = dtypelab.bench(f"{TINY}:make_task", "fp32,bf16,amp-fp16", steps=30, isolate=False, hardware=hw,
                           json_path=str(tmp / "train.json"), force=True)
    infer = dtypelab.bench(f"{TINY}:make_task", "int8-dyn,bf16", mode="infer", steps=4, warmup=1, per_layer=True,
                           isolate=False, hardware=hw, json_path=str(tmp / "infer.json"))
    assert train.result("amp-fp16").scaler and infer.result("int8-dyn").per_layer
    lint = dtypelab.lint_paths([os.path.join(ROOT, "examples")])
    (tmp / "lint.json").write_text(lint.to_json())
    import nan_models

    traced = dtypelab.trace(nan_models.log_task(), hardware=hw, json_path=str(tmp / "trace.json"))
    assert traced.status == "found" and len(traced.losses) > 5
    return {"train": str(tmp / "train.json"), "infer": str(tmp / "infer.json"), "lint": str(tmp / "lint.json"),
            "trace": str(tmp / "trace.json"),
            **{f"v1-{n}": os.path.join(V1, f"{n}.json") for n in ("bench_train", "bench_infer", "audit", "trace")}}


def _plots(page: str) -> dict[str, str]:
    return dict(re.findall(r"data-plot='([^']+)'><div class='svg'>(<svg.*?</svg>)", page, re.S))


def test_every_record_kind_gets_its_charts_and_nothing_is_fetched(records, tmp_path):
    out = tmp_path / "all.html"
    info = report(list(records.values()), str(out))
    page = out.read_text()
    assert info.records == 8 and info.bytes == len(page.encode()) and not FETCHES.search(page)
    plots = _plots(page)
    kinds = {key.split("-", 1)[1] for key in plots}
    assert kinds >= {"loss", "times", "pareto", "memory", "scaler", "fidelity", "size", "layers", "heatmap",
                     "binades"}, kinds
    for key, svg in plots.items():
        assert svg.count("<path") >= 3, key  # axes and data, not an empty frame
    assert "dtypelab trace" in page and "first non-finite" in page and "DTL" in page  # trace card, lint table
    for figure in re.findall(r"<figure.*?</figure>", page, re.S):
        assert re.search(r"<figcaption>[^<]{20,}</figcaption>", figure)  # each chart says what to read from it


def test_raw_records_are_embedded_and_round_trip(records, tmp_path):
    page = report([records["train"], records["v1-audit"]], str(tmp_path / "r.html")).html
    blobs = re.findall(r"download='([^']+)' href='data:application/json;base64,([A-Za-z0-9+/=]+)'", page)
    assert [name for name, _ in blobs] == ["train.json", "audit.json"]
    import base64

    assert json.loads(base64.b64decode(blobs[0][1])) == load_record(records["train"]).to_dict()
    assert "command: <code>" in page and "hardware:" in page and "torch " in page  # the environment, recorded


def test_version_1_records_render(records):
    page = report_html([load_record(records[k]) for k in records if k.startswith("v1-")])
    assert page.count("<section class='record'") == 4 and len(_plots(page)) >= 5


def test_user_strings_are_escaped(tmp_path):
    record = load_record(os.path.join(V1, "trace.json"))
    import dataclasses

    origin = dataclasses.replace(record.finding.origin, source="model.py:3",
                                 code="x = torch.cat([a, b]) <script>alert(1)</script>")
    record = dataclasses.replace(record, finding=dataclasses.replace(record.finding, origin=origin))
    page = report_html([record])
    assert "<script>alert(1)" not in page and "torch.cat([a, b]) &lt;script&gt;" in page


def test_pareto_front():
    points = [("a", 1.0, 0.9), ("b", 2.0, 0.8), ("c", 1.5, 0.7), ("d", 0.5, 0.95)]
    assert [p[0] for p in pareto(points, higher=True)] == ["d", "a", "b"]
    assert [p[0] for p in pareto(points, higher=False)] == ["c", "b"]


def test_report_cli_and_html_flags(records, tmp_path):
    from test_cli import dtypelab as cli

    out = tmp_path / "page.html"
    run = cli("report", records["train"], records["v1-trace"], "-o", str(out))
    assert run.returncode == 0, run.stderr
    assert f"wrote {out}: 2 records" in run.stdout and out.stat().st_size > 10_000
    bad = cli("report", "nowhere.json")
    assert bad.returncode == 2 and "no such result file: nowhere.json" in bad.stderr and "Traceback" not in bad.stderr
    html = tmp_path / "trace.html"
    traced = cli("trace", f"{TINY}:make_task", "--steps", "3", "--json", str(tmp_path / "t.json"), "--html", str(html))
    assert traced.returncode == 0 and "report written to" in traced.stderr
    import base64

    blobs = re.findall(r"href='data:application/json;base64,([A-Za-z0-9+/=]+)'", html.read_text())
    written = load_record(str(tmp_path / "t.json"))
    assert [json.loads(base64.b64decode(b)) for b in blobs] == [written.to_dict()]  # the page is of this run's record


# --- in a real browser -----------------------------------------------------------------------------------------
def _chromium() -> str | None:
    return os.environ.get("DTYPELAB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
def test_reports_in_a_real_browser_offline(records, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium found (sh scripts/browser.sh installs Debian's, or set DTYPELAB_CHROMIUM)")
    os.makedirs(ARTIFACTS, exist_ok=True)
    pages = {"bench-train": [records["train"]], "bench-infer": [records["infer"]],
             "audit": [records["v1-audit"]], "trace-and-lint": [records["trace"], records["lint"]]}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            for name, files in pages.items():
                path = tmp_path / f"{name}.html"
                report(files, str(path))
                context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
                page = context.new_page()
                errors, failed, requests = [], [], []
                page.on("console", lambda m, e=errors: e.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda exc, e=errors: e.append(str(exc)))
                page.on("requestfailed", lambda r, f=failed: f.append(r.url))
                page.on("request", lambda r, q=requests: q.append(r.url))
                page.goto(path.as_uri(), wait_until="load")
                figures = page.locator("figure.plot")
                assert figures.count() >= 1, name
                if name.startswith("trace"):
                    assert page.locator("table.card tr").count() >= 8  # the finding, as a card
                for i in range(figures.count()):
                    svg = figures.nth(i).locator("svg")
                    assert svg.count() == 1 and svg.locator("path").count() >= 3, (name, i)
                    box = svg.bounding_box()
                    assert box and box["width"] > 200 and box["height"] > 80, (name, i, box)
                page.screenshot(path=os.path.join(ARTIFACTS, f"{name}.png"), full_page=True)
                context.close()
                assert errors == [] and failed == [], (name, errors, failed)
                assert requests == [path.as_uri()], (name, requests)  # the page itself, nothing else
        finally:
            browser.close()


def test_drawing_leaves_matplotlib_as_it_was(records):
    """A report made in a notebook or GUI program must not switch its backend or change its rcParams."""
    import matplotlib

    before, backend = dict(matplotlib.rcParams), matplotlib.rcParams._get_backend_or_none()
    with matplotlib.rc_context({"font.size": 31.0, "lines.linewidth": 7.0}):
        report_html([load_record(records["train"]), load_record(records["v1-audit"])])
        assert matplotlib.rcParams["font.size"] == 31.0 and matplotlib.rcParams["lines.linewidth"] == 7.0
    assert dict(matplotlib.rcParams) == before and matplotlib.rcParams._get_backend_or_none() == backend


def test_audit_histograms_for_the_riskiest_of_each_kind_or_the_layers_chosen(records):
    record = load_record(records["v1-audit"])
    default = _plots(report_html([record]))
    kinds = {layer.kind for layer in record.layers if layer.stats.get("binades")}
    assert sum(k.startswith("r1-binades") for k in default) == len(kinds) >= 1
    chosen = [layer.name for layer in record.layers if layer.stats.get("binades")][-1]
    page = report_html([record], layers=f"^{re.escape(chosen)}$")
    assert sum(k.startswith("r1-binades") for k in _plots(page)) >= 1 and "chosen with --layer" in page
    with pytest.raises(dtypelab.DtypelabError, match="not a valid regular expression"):
        report([records["v1-audit"]], layers="([")


def test_render_has_no_import_circle_and_each_record_kind_is_drawn_by_its_own_module():
    import ast
    from pathlib import Path

    import dtypelab.render
    from dtypelab.core.results import AuditReport, ForecastReport, LintReport, Report, TraceReport, TuneReport
    from dtypelab.render.drawing import more_of
    from dtypelab.render.views import SECTIONS

    root = Path(dtypelab.render.__file__).parent
    modules = {path.stem for path in root.glob("*.py")}

    def imported(node: ast.AST) -> set[str]:
        """The render modules one import names: ``from dtypelab.render.x import …``, ``from dtypelab.render import
        x`` and ``import dtypelab.render.x``."""
        if isinstance(node, ast.ImportFrom) and node.module == "dtypelab.render":
            return {a.name for a in node.names if a.name in modules}
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dtypelab.render."):
            return {node.module.split(".")[2]}
        if isinstance(node, ast.Import):
            return {a.name.split(".")[2] for a in node.names if a.name.startswith("dtypelab.render.")}
        return set()

    graph = {path.stem: set().union(*map(imported, ast.walk(ast.parse(path.read_text()))))
             for path in root.glob("*.py")}
    assert "plots" in graph["trace"]  # `from dtypelab.render import plots` is seen

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(m == goal or (m not in seen and reaches(m, goal, seen | {m})) for m in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m, set())] == []
    # the registry imports no renderer, statically or by discovery: they import it
    assert graph["views"] <= {"__init__"} and "importlib" not in (root / "views.py").read_text()
    more_of(object())  # loads every renderer, and so their registrations
    for kind in (Report, AuditReport, TraceReport, LintReport, TuneReport, ForecastReport):
        assert SECTIONS[kind].__module__ not in ("dtypelab.render.page", "dtypelab.render.views",
                                                 "dtypelab.render.drawing")
