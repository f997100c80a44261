"""Regenerate docs/report-worked-example.png from a run (tests/unit/present/test_report_png.py runs it).

    python docs/make_report_png.py [--out docs/report-worked-example.png]

Runs the worked example (``infertrace run -p "The capital of" -n 3 --save``, the prompt of
fixtures/golden/worked-example-cells), renders its report (``infertrace report``), screenshots the page
with headless Chromium at 1200 x 2450 (the top: facts, worked example, cache over time, step 0), and
writes beside the picture ``<out>.json``: the trace facts the picture shows (step 0's kq_mask ``ne`` and
``n_kv``, the tokens), so a test can tell a stale picture from the trace the code writes now.
The PNG is quantised to 256 colours when Pillow is importable (it keeps the file small).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of"
WINDOW = (1200, 2450)


def chromium() -> str:
    """The Chromium binary (``chromium`` or ``chromium-browser`` on PATH); SystemExit naming the fix otherwise."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("error: chromium not on PATH (apt-get install -y chromium)")
    return exe


def facts(trace_json: Path) -> dict:
    """What the picture shows of the trace: the tokens and step 0's kq_mask shape and n_kv."""
    d = json.loads(trace_json.read_text())
    km = d["steps"][0]["mask"]["kq_mask"]
    return {"prompt": PROMPT, "prompt_ids": d["requests"][0]["prompt_ids"], "output_ids": d["requests"][0]["output_ids"],
            "kq_mask_ne": km["ne"], "n_kv": km["n_kv"], "model": d["model"]["file"], "window": list(WINDOW)}


def make(out: Path) -> dict:
    """Run, report, screenshot; write ``out`` and ``out.json``; return the facts."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        run = [sys.executable, "-m", "infertrace", "run", "-p", PROMPT, "-n", "3", "--save", str(t / "worked-example"),
               "--keep", "summary"]
        subprocess.run(run, check=True, env=env, capture_output=True, timeout=900)
        page = t / "report.html"
        subprocess.run([sys.executable, "-m", "infertrace", "report", "worked-example", "-o", str(page)],
                       check=True, env=env, capture_output=True, timeout=300, cwd=t)  # the page names "worked-example"
        shot = t / "shot.png"
        subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                        "--disable-background-networking", "--disable-component-update", f"--user-data-dir={t / 'profile'}",
                        f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={shot}", page.as_uri()],
                       check=True, capture_output=True, timeout=300)
        try:
            from PIL import Image

            Image.open(shot).convert("RGB").quantize(256).save(shot, optimize=True)
        except ImportError:
            pass
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, out)
        f = facts(t / "worked-example" / "trace.json")
    Path(str(out) + ".json").write_text(json.dumps(f, indent=1) + "\n")
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "report-worked-example.png")
    a = ap.parse_args()
    f = make(a.out)
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e3:.0f} kB): kq_mask ne {f['kq_mask_ne']}, n_kv {f['n_kv']}")


if __name__ == "__main__":
    main()
