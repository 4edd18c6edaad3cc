"""Size and render time of the HTML report for the records given, and their load time in headless Chromium.

    python benchmarks/report_pages.py dtypelab-results/digits-train-*.json dtypelab-results/minilm-infer-*.json ...

Each record gets its own page (and all of them one page together): the time `dtypelab.report` takes to draw
and write it (best of 3), its size, its chart count, and, when Playwright and a Chromium are here, the time
the browser takes to load it offline plus a full-page screenshot under test-artifacts/report-pages/.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from dtypelab.render.page import report

OUT = os.path.join(os.path.dirname(__file__), "..", "test-artifacts", "report-pages")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("records", nargs="+")
    args = ap.parse_args()
    pages = {os.path.splitext(os.path.basename(p))[0]: [p] for p in args.records}
    if len(args.records) > 1:
        pages["all"] = list(args.records)
    os.makedirs(OUT, exist_ok=True)
    chromium = os.environ.get("DTYPELAB_CHROMIUM") or shutil.which("chromium")
    with tempfile.TemporaryDirectory() as tmp:
        built = {}
        for name, files in pages.items():
            path = os.path.join(tmp, f"{name}.html")
            times = []
            for _ in range(3):
                start = time.perf_counter()
                info = report(files, path)
                times.append(time.perf_counter() - start)
            built[name] = path
            print(f"{name:28s} {info.bytes / 1024:7.0f} KB  {info.plots:2d} charts  drawn in {min(times):.2f} s")
        if chromium is None:
            print("no Chromium: load times skipped")
            return
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            for name, path in built.items():
                page = browser.new_context(offline=True, viewport={"width": 1280, "height": 900}).new_page()
                start = time.perf_counter()
                page.goto("file://" + path, wait_until="load")
                load = time.perf_counter() - start
                shot = os.path.join(OUT, f"{name}.png")
                page.screenshot(path=shot, full_page=True)
                print(f"{name:28s} loaded in {load * 1e3:.0f} ms; screenshot {os.path.relpath(shot)}")
            browser.close()


if __name__ == "__main__":
    main()
