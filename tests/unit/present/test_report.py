"""``infertrace report``: one self-contained HTML page (no network), its pictures, the derived
views (replaying find_slot / the block pool from the records reproduces what the backend
recorded), and a real headless Chromium load with no console errors.

The golden traces (``fixtures/golden``) serve as inputs, so most tests need no model; the
Chromium tests skip cleanly when ``chromium`` is not on PATH (CI installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.present.report import build_report
from infertrace.present.report_views import recorded_cells, recorded_tables, simulate_cells, simulate_paged
from infertrace.trace.store import load_trace

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "golden"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not on PATH (apt-get install -y chromium)")


def golden(name: str):
    p = GOLDEN / name
    if not (p / "trace.json").is_file():
        pytest.fail(f"golden {name} missing (pytest --infertrace-update tests/real_models/test_snapshots.py)")
    return p


def report_file(tmp_path: Path, name: str) -> Path:
    out = tmp_path / f"{name}.html"
    res = CliRunner().invoke(app, ["report", str(golden(name)), "-o", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    assert res.stdout.startswith(f"wrote {out}")
    return out


@pytest.mark.parametrize("name", ["worked-example-cells", "batching-paged"])
def test_report_is_self_contained(tmp_path, name):
    html = report_file(tmp_path, name).read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"<link\b|<img\b|<iframe\b|@import|url\(", html, re.I)
    assert not re.search(r"<script[^>]*\bsrc=", html, re.I)
    n = len(load_trace(golden(name)).steps)
    assert html.count('<section class="step"') == n
    assert html.count('class="heatmap kq-mask"') == n and 'class="occupancy cellmap"' in html
    assert 'class="occupancy blocktables"' in html and 'class="topk-bar"' in html


def test_report_labels_recorded_and_derived_views():
    cells = build_report(load_trace(golden("batching-cells")))
    assert "find_slot replayed from the records gives the same map" in cells
    assert "paged block tables</b> this cells run never had: derived" in cells
    assert "recorded slice" in cells and "matches" in cells and "≠ logical" not in cells
    paged = build_report(load_trace(golden("batching-paged")))
    assert "the allocation replayed from the records agrees" in paged
    assert "llama.cpp cell map</b> this paged run never had: derived" in paged
    assert "llama.cpp kq_mask</b> this paged run never built: derived" in paged and "≠ logical" not in paged


def test_replayed_allocation_matches_the_backends():
    """The derived views are only honest if replaying the records gives what each backend recorded."""
    tc = load_trace(golden("batching-cells"))
    assert [recorded_cells(s) for s in tc.steps] == simulate_cells(tc)
    tp = load_trace(golden("batching-paged"))
    tables, B, nb = simulate_paged(tp)
    assert B == 4 and [recorded_tables(s) for s in tp.steps] == tables


def test_report_errors_are_one_line(tmp_path):
    res = CliRunner().invoke(app, ["report", str(golden("worked-example-cells")), "-o", str(tmp_path / "no" / "dir" / "r.html")])
    assert res.exit_code == 2 and res.stderr.startswith("error: cannot write") and res.stderr.count("\n") == 1


# ----------------------------------------------------------------------------- headless Chromium


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def status_of(dom: str) -> dict[str, str]:
    m = re.search(r'<div id="report-status"([^>]*)>([^<]*)</div>', dom)
    assert m, dom[-2000:]
    attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', m.group(1)))
    attrs["text"] = m.group(2)
    return attrs


@needs_chromium
@pytest.mark.parametrize("name, steps", [("worked-example-cells", 3), ("batching-paged", 0)])
def test_report_loads_in_chromium_without_errors(tmp_path, name, steps):
    page = report_file(tmp_path, name)
    res = chromium(tmp_path, "--dump-dom", page.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    st = status_of(dom)
    n = steps or len(load_trace(golden(name)).steps)
    assert st["state"] == "ok", (st, re.search(r'<pre id="console-errors">([^<]*)', dom).group(1))
    assert re.search(r'<pre id="console-errors"></pre>', dom)
    assert int(st["steps"]) == n and int(st["heatmaps"]) >= 3 * n and int(st["cellmaps"]) == 2 and int(st["bars"]) > 0
    assert dom.count('<section class="step') == n
    assert dom.count('<button') == n + 1  # the step filter the script built
    assert "Uncaught" not in res.stderr and "CONSOLE" not in res.stderr  # chromium's own log of page errors


@needs_chromium
def test_chromium_harness_catches_page_errors(tmp_path):
    """The capture works: a page that logs console.error / throws is reported as failing."""
    page = report_file(tmp_path, "worked-example-cells")
    html = page.read_text(encoding="utf-8")
    page.write_text(html.replace("</main>", "</main><script>console.error('boom'); undefined_function();</script>"),
                    encoding="utf-8")
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    st = status_of(dom)
    errors = re.search(r'<pre id="console-errors">([^<]*)</pre>', dom).group(1)
    assert st["state"] == "error" and "console.error: boom" in errors and "undefined_function" in errors


@needs_chromium
def test_report_screenshot(tmp_path):
    page = report_file(tmp_path, "worked-example-cells")
    shot = tmp_path / "shot.png"
    res = chromium(tmp_path, "--hide-scrollbars", "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri())
    assert res.returncode == 0 and shot.is_file()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
