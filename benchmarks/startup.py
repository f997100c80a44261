"""Whole-process wall time of the everyday commands (median of ``--repeats``), beside the goal.

    python benchmarks/startup.py [--repeats 5] [--cold] [--model PATH]

Each command runs as its own process (``python -m infertrace ...``), output discarded, so the
figure includes interpreter start, imports, model-file reading and rendering. A trace saved once
with ``run --save`` (``--max-new-tokens 4``) feeds ``show``/``report``/``diff``. ``--cold`` points
``XDG_CACHE_HOME`` at a fresh empty directory for every single run, so the GGUF metadata cache
never helps (the first-run-on-a-new-machine figure). Beside the wall time it prints the child's CPU
time (user + system): on a machine shared with other work that is the better estimate of the wall
time on an idle one. Nothing here is asserted: speed is measured, not tested.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOALS = {  # command label -> goal in seconds (issue 14)
    "infertrace --help": 0.5,
    "infertrace inspect": 1.5,
    "infertrace show DIR --step 1": 1.5,
    "infertrace report DIR -o FILE": 1.5,
    "infertrace diff DIR DIR": 1.5,
    "infertrace run --prompt hi --max-new-tokens 1": 4.0,
}


def timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """(wall, CPU) seconds of one whole process; raises when the command fails (a broken
    benchmark, not a slow one). CPU = user + system time of the child: on a machine shared with
    other work it is close to what the wall time would be on an idle one."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "infertrace", *argv], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, cwd=cwd)  # cwd: `-m` puts it first on sys.path
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:  # the same trace twice: diff exits 0 too
        raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return dt, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="a fresh empty XDG_CACHE_HOME for every run")
    ap.add_argument("--model", default=None, help="model for inspect/run (default: the default model)")
    a = ap.parse_args()
    model = [a.model] if a.model else []
    with tempfile.TemporaryDirectory(prefix="infertrace-startup-") as tmp:
        env = dict(os.environ)
        trace = str(Path(tmp) / "trace")
        subprocess.run([sys.executable, "-m", "infertrace", "run", *(["--model", a.model] if a.model else []),
                        "--prompt", "hi", "--max-new-tokens", "4", "--save", trace],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
        report = str(Path(tmp) / "report.html")
        cases = {
            "infertrace --help": ["--help"],
            "infertrace inspect": ["inspect", *model],
            "infertrace show DIR --step 1": ["show", trace, "--step", "1"],
            "infertrace report DIR -o FILE": ["report", trace, "-o", report, "--force"],
            "infertrace diff DIR DIR": ["diff", trace, trace],
            "infertrace run --prompt hi --max-new-tokens 1":
                ["run", *(["--model", a.model] if a.model else []), "--prompt", "hi", "--max-new-tokens", "1"],
        }
        import_check = subprocess.run([sys.executable, "-c", "import infertrace; print(infertrace.__file__)"], env=env,
                                      cwd=tmp, capture_output=True, text=True).stdout.strip()
        print(f"infertrace from {import_check}")
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, median of {a.repeats}"
              f"{', cold cache every run' if a.cold else ''}")
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
        print("| command | median wall s | min wall s | median CPU s | goal s | met (wall) |")
        print("| --- | ---: | ---: | ---: | ---: | :---: |")
        for label, argv in cases.items():
            walls, cpus = [], []
            for i in range(a.repeats):
                run_env = env
                if a.cold:
                    run_env = dict(env, XDG_CACHE_HOME=tempfile.mkdtemp(dir=tmp, prefix="cache-"))
                w, c = timed(argv, run_env, tmp)
                walls.append(w)
                cpus.append(c)
            med = statistics.median(walls)
            goal = GOALS[label]
            print(f"| `{label}` | {med:.2f} | {min(walls):.2f} | {statistics.median(cpus):.2f} | {goal:.1f} | "
                  f"{'yes' if med <= goal else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
