"""The documentation: README.md is the front door (at most 300 lines, every command of its tour runs
as printed) and docs/ is a site that ``mkdocs build --strict`` builds without a warning, where every
page is in the nav, every relative link resolves and the module map matches the tree.

The tour's commands are read from README.md's fenced ``bash`` blocks and run in a temporary directory,
in README order, ``infertrace ...`` as ``python -m infertrace ...`` and ``python ...`` with this
interpreter, with this checkout on ``PYTHONPATH``; each must exit 0 and print its key line, which the
README's pasted output must show too. Every command of the README needs an entry in :data:`TOUR` (a key
line, or a reason it is skipped), so a command added to the README without being run here fails.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"
PACKAGE = ROOT / "infertrace"
MAX_README_LINES = 300


# ----------------------------------------------------------------------------------------- markdown

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``[(language, body)]`` of the fenced code blocks of a Markdown text, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text without fenced blocks and inline code spans (where a ``[x](y)`` is not a link)."""
    text = FENCE.sub("", text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def relative_links(text: str) -> list[str]:
    """Targets of the Markdown links and images that point into the repository (not a URL, not
    only an anchor), without their ``#anchor``."""
    out = []
    for target in LINK.findall(prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def markdown_files() -> list[Path]:
    return [README] + sorted(DOCS.rglob("*.md"))


# ------------------------------------------------------------------------------------------- mkdocs

def _yaml():
    try:
        import yaml
    except ImportError as e:  # PyYAML comes with mkdocs: the dev extra installs both
        pytest.fail(f"PyYAML is not importable ({e}); install the dev extra: pip install -e '.[dev]'", pytrace=False)
    return yaml


def nav_pages(nav) -> list[str]:
    """Every page path in a mkdocs ``nav`` (nested lists of ``{title: path}``, plain paths, sections)."""
    out: list[str] = []
    for item in nav or []:
        values = item.values() if isinstance(item, dict) else [item]
        for v in values:
            if isinstance(v, list):
                out += nav_pages(v)
            elif isinstance(v, str) and not re.match(r"^[a-z]+://", v):
                out.append(v)
    return out


def mkdocs_config() -> dict:
    return _yaml().safe_load(MKDOCS_YML.read_text(encoding="utf-8"))


def test_every_page_is_in_the_nav_once_and_every_nav_entry_exists():
    """Orphans fail: mkdocs only logs a page missing from the nav at INFO level, so it is checked here."""
    cfg = mkdocs_config()
    assert cfg.get("docs_dir", "docs") == "docs"
    nav = nav_pages(cfg["nav"])
    assert len(nav) == len(set(nav)), [p for p in nav if nav.count(p) > 1]
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert sorted(pages - set(nav)) == [], "pages under docs/ missing from mkdocs.yml's nav (orphans)"
    assert sorted(set(nav) - pages) == [], "nav entries with no page under docs/"


def test_relative_links_resolve():
    """Every relative link or image of the README and of each page points at a file that exists;
    a page's links stay inside docs/ (the site holds nothing else)."""
    broken = []
    for md in markdown_files():
        for target in relative_links(md.read_text(encoding="utf-8")):
            if not target:
                continue
            dest = (md.parent / target).resolve()
            if not dest.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
            elif md != README and DOCS.resolve() not in dest.parents:
                broken.append(f"{md.relative_to(ROOT)}: {target} (outside docs/: not in the site)")
    assert broken == []


def test_link_finder_sees_links_and_not_code():
    text = "a [x](docs/a.md#b) ![i](p.png) `[c](d.md)` [u](https://e.org) [s](#top)\n```bash\n[e](f.md)\n```\n"
    assert relative_links(text) == ["docs/a.md", "p.png"]
    assert nav_pages([{"A": "a.md"}, {"S": [{"B": "s/b.md"}, "c.md"]}, {"L": "https://x.org"}]) == ["a.md", "s/b.md", "c.md"]


def test_mkdocs_build_strict(tmp_path):
    """``mkdocs build --strict`` (every warning an error: broken links and anchors, missing nav
    targets, omitted files, a snippet whose file is missing) builds every page of the nav."""
    try:
        import material  # noqa: F401  mkdocs-material
        import mkdocs  # noqa: F401
    except ImportError as e:
        pytest.fail(f"mkdocs / mkdocs-material are not importable ({e}); install the dev extra: "
                    "pip install -e '.[dev]'", pytrace=False)
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life banner, not a build warning
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(MKDOCS_YML), "-d", str(site)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    assert not re.search(r"^(WARNING|ERROR)\b", log, re.M), log
    for page in nav_pages(mkdocs_config()["nav"]):
        html = site / (page[:-3] + "/index.html" if page != "index.md" else "index.html")
        assert html.is_file(), (page, html)
    bench = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert "quant_parity.py" in bench and "--8&lt;--" not in bench and "--8<--" not in bench  # the snippet was included


# ------------------------------------------------------------------------------------------- README

def test_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    n = len(text.splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail into a page under docs/"
    for needed in ("make demo", "make test", "make setup-dev", "docs/report-worked-example.png", "docs/index.md"):
        assert needed in text, needed


# ------------------------------------------------------------------------------------------- module map

def module_map() -> str:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    start = text.index("\n## Module map")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def package_modules() -> set[str]:
    """The modules the map must list: every file under infertrace/ except the ``__init__.py`` files that
    hold little more than their docstring and imports (100 lines or fewer)."""
    out = set()
    for f in PACKAGE.rglob("*.py"):
        if f.name == "__init__.py" and len(f.read_text(encoding="utf-8").splitlines()) <= 100:
            continue
        out.add(f.relative_to(PACKAGE).as_posix())
    return out


def test_module_map_lists_every_module_once():
    """docs/architecture.md's module map against the tree: each module exactly once, nothing that is gone."""
    named = re.findall(r"^\| `([\w/]+\.py)` \|", module_map(), re.M)  # the first cell of each table row
    assert len(named) > 100
    assert [m for m in set(named) if named.count(m) > 1] == [], "listed more than once"
    assert sorted(m for m in set(named) if not (PACKAGE / m).is_file()) == [], "listed but not in infertrace/"
    assert sorted(package_modules() - set(named)) == [], "in infertrace/ but missing from the module map"


# ------------------------------------------------------------------------------------------- the tour

def norm(cmd: str) -> str:
    """One spelling per command: its words as the shell splits them (comments dropped), re-quoted."""
    return shlex.join(shlex.split(cmd, comments=True))


@dataclass(frozen=True)
class Expect:
    """What a README command must print (``key``: a substring of its output, also shown in the
    README), or why it is not run here (``skip``)."""

    key: str = ""
    skip: str = ""
    marks: tuple = field(default_factory=tuple)


_SETUP = ("creates .venv and installs torch, the project and the models from the package index (network, "
          "minutes); the venv this test runs in is what it makes")
_TOUR: dict[str, Expect] = {
    "make demo": Expect(skip=_SETUP + "; the command it runs, infertrace run, is run below"),
    "make test": Expect(skip=_SETUP + ", builds llama.cpp from source (make setup-dev, up to half an hour) and "
                        "runs the whole suite, this test included"),
    'infertrace run --prompt "The capital of" --max-new-tokens 3 --save runs/we':
        Expect("output seq 0: 'The capital of' → ' the United States'  (stop: max_new_tokens, 3 tokens)"),
    "infertrace show runs/we --step 0 --var mask": Expect("│ seq 0 visible keys: q0→0  q1→0..1  q2→0..2"),
    'infertrace dump-kv --step 2 --prompt "The capital of" --prompt "Hello" --arrival 0 --arrival 1 --backend paged '
    "--tokens-per-block 4": Expect("│ 0     5     [0, 2]        0: 0..3 · 2: 4"),
    'infertrace diff-backends --prompt "The capital of" --prompt "Hello" --arrival 0 --arrival 1 --prefill-chunk 2 -n 3':
        Expect("logically identical: 4 steps (0 idle), 2 requests, 8 queries"),
    'infertrace run --prompt "The capital of" -n 3 --runtime llama.cpp --teacher-force runs/we --save runs/lcf':
        Expect("output seq 0: 'The capital of' → ' the United States'"),
    "infertrace diff runs/we runs/lcf": Expect("structure: identical"),
    'infertrace run --prompt "The capital of" -n 3 --runtime vllm --save runs/vl':
        Expect("output seq 0: 'The capital of' → ' the United States'", marks=(pytest.mark.vllm, pytest.mark.slow)),
    "infertrace diff runs/lcf runs/vl": Expect("logical variables: identical", marks=(pytest.mark.vllm,)),
    "infertrace check runs/vl": Expect("no violation", marks=(pytest.mark.vllm,)),
    "infertrace report runs/we -o report.html": Expect("wrote report.html ("),
    "python -m pytest -q tests/test_my_engine.py --infertrace-update": Expect("infertrace: wrote 1 golden trace(s):"),
    "python -m pytest -q tests/test_my_engine.py": Expect("1 passed"),
}
#: the commands above in the normal form of :func:`norm` (the keys as printed in the README)
TOUR = {norm(k): v for k, v in _TOUR.items()}


def readme_commands(text: str | None = None) -> list[str]:
    """The commands of README.md's ``bash`` blocks (continuation lines joined, comments dropped), each
    in the normal form of :func:`norm`, in order."""
    text = README.read_text(encoding="utf-8") if text is None else text
    out = []
    for lang, body in fenced_blocks(text):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                out.append(norm(line))
    return out


def readme_files() -> dict[str, str]:
    """Files the tour's ``python`` blocks define (a block whose first line is ``# <relative path>``)."""
    out = {}
    for lang, body in fenced_blocks(README.read_text(encoding="utf-8")):
        first = body.splitlines()[0] if body.strip() else ""
        if lang == "python" and (m := re.fullmatch(r"#\s*([\w./-]+\.py)", first.strip())):
            out[m.group(1)] = body
    return out


def test_readme_commands_are_found():
    cmds = readme_commands("```bash\nmake demo    # a comment\ninfertrace run -p \"a b\" \\\n   -n 2\n```\n")
    assert cmds == ["make demo", norm('infertrace run -p "a b" -n 2')] == ["make demo", "infertrace run -p 'a b' -n 2"]
    assert sorted(readme_files()) == ["tests/test_my_engine.py"]


def test_every_readme_command_has_an_expectation():
    """A command in the README without an entry in TOUR (or an entry whose command left the README) fails."""
    cmds = readme_commands()
    assert len(cmds) == len(set(cmds))
    assert sorted(set(cmds) - set(TOUR)) == [], "README commands this test does not run (add them to TOUR)"
    assert sorted(set(TOUR) - set(cmds)) == [], "TOUR entries no longer in the README"
    text = README.read_text(encoding="utf-8")
    for cmd, exp in TOUR.items():  # the README's pasted output shows what the command is checked for
        assert exp.skip or exp.key in text, (cmd, exp.key)


class Tour:
    """Runs the README's commands in one temporary directory, in README order, each at most once:
    a command runs the ones before it first (so ``-k`` can pick any one of them)."""

    def __init__(self, cwd: Path):
        self.cwd, self.done = cwd, {}
        for rel, body in readme_files().items():
            (cwd / rel).parent.mkdir(parents=True, exist_ok=True)
            (cwd / rel).write_text(body, encoding="utf-8")
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}

    def argv(self, cmd: str) -> list[str]:
        words = shlex.split(cmd)
        if words[0] == "infertrace":
            return [sys.executable, "-m", "infertrace", *words[1:]]
        if words[0] == "python":
            return [sys.executable, *words[1:]]
        raise AssertionError(f"no way to run {cmd!r} here: give it a skip reason in TOUR")

    def run(self, cmd: str) -> str:
        cmds = [c for c in readme_commands() if not TOUR[c].skip]
        for before in cmds[: cmds.index(cmd)]:
            if before not in self.done:
                self.run(before)
            if self.done[before][0] != 0:
                pytest.fail(f"an earlier README command failed: {before}", pytrace=False)
        if cmd not in self.done:
            p = subprocess.run(self.argv(cmd), cwd=self.cwd, env=self.env, capture_output=True, text=True,
                               timeout=1200, stdin=subprocess.DEVNULL)
            self.done[cmd] = (p.returncode, p.stdout + p.stderr)
        rc, out = self.done[cmd]
        assert rc == 0, f"{cmd}\nexit {rc}\n{out[-4000:]}"
        return out


    def run_check(self, trace_dir: Path) -> str:
        """``infertrace check DIR`` on a trace the tour saved: its output (exit 0 required)."""
        p = subprocess.run([sys.executable, "-m", "infertrace", "check", str(trace_dir)], cwd=self.cwd, env=self.env,
                           capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert p.returncode == 0, f"check {trace_dir.name}: exit {p.returncode}\n{p.stdout}{p.stderr}"
        return p.stdout


@pytest.fixture(scope="module")
def tour(tmp_path_factory) -> Tour:
    return Tour(tmp_path_factory.mktemp("readme-tour"))


def _params():
    try:
        cmds = readme_commands()
    except (OSError, ValueError):
        cmds = []
    return [pytest.param(c, marks=list(TOUR[c].marks) if c in TOUR else [], id=c[:60]) for c in cmds]


@pytest.mark.model
@pytest.mark.parametrize("cmd", _params())
def test_readme_command_runs_as_printed(tour, cmd):
    exp = TOUR.get(cmd)
    assert exp is not None, f"README command {cmd!r} has no entry in TOUR"
    if exp.skip:
        pytest.skip(f"{cmd}: {exp.skip}")
    out = tour.run(cmd)
    assert exp.key in out, f"{cmd}: {exp.key!r} not in its output:\n{out[-4000:]}"


@pytest.mark.model
@pytest.mark.vllm
def test_readme_tour_traces_pass_check(tour):
    """Every trace the tour saves (ours, llama.cpp's, vLLM's) passes ``infertrace check``."""
    runnable = [c for c in readme_commands() if not TOUR[c].skip]
    tour.run(runnable[-1])
    saved = sorted(d for d in (tour.cwd / "runs").iterdir() if (d / "trace.json").is_file())
    assert len(saved) >= 3, saved
    for d in saved:
        out = tour.run_check(d)
        assert out.startswith("ok: ") and "no violation" in out, (d.name, out)
