"""pytest plugin: golden-trace snapshot tests (registered as ``pytest11`` entry point ``infertrace``).

Use::

    def test_worked_example(infertrace_snapshot, smol):
        infertrace_snapshot.check("worked-example-cells", ["The capital of"], loaded=smol, max_new_tokens=3)

``check`` runs the scenario (reusing ``loaded`` when given, else loading the model once per
session), turns the trace into its summary manifest (no tensors, no timings, no paths) and
compares it with ``<golden dir>/<name>/trace.json`` by :func:`infertrace.trace.diff.diff_traces`:
floats within ``atol``/``rtol`` (default 1e-4 each, so float noise across CPUs passes), ints
and strings exactly. On a difference the test fails with the first divergence and its
context. ``pytest --infertrace-update`` (re)writes the goldens instead of comparing.

Settings: ini ``infertrace_golden_dir`` (default ``fixtures/golden``, relative to the rootdir).
Nothing heavy is imported until a test uses the fixture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import pytest

DEFAULT_DIR = "fixtures/golden"
_MODELS: dict[str, Any] = {}
_WRITTEN: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("infertrace", "infertrace golden traces")
    group.addoption("--infertrace-update", action="store_true", default=False,
                    help="rewrite infertrace golden traces from the current run instead of comparing")
    parser.addini("infertrace_golden_dir", f"directory of infertrace golden traces (default {DEFAULT_DIR})", default=DEFAULT_DIR)


def golden_text(manifest: dict[str, Any]) -> str:
    """Golden file text: sorted keys, one line per step (small, and a git diff names the step)."""
    from infertrace.trace.store import canonical_json

    lines = ["{"]
    keys = sorted(manifest)
    for i, k in enumerate(keys):
        end = "," if i < len(keys) - 1 else ""
        val = manifest[k]
        if k == "steps" and val:
            items = ",\n".join("  " + canonical_json(s, indent=None).rstrip("\n") for s in val)
            lines.append(f'"{k}": [\n{items}\n]{end}')
        else:
            lines.append(f'"{k}": {canonical_json(val, indent=None).rstrip()}{end}')
    return "\n".join(lines) + "\n}\n"


def _specs(prompts: Iterable[Any], defaults: dict[str, Any]) -> list[Any]:
    from infertrace.engine.sampler import SamplingParams
    from infertrace.runner import PromptSpec

    out = []
    for p in prompts:
        if isinstance(p, PromptSpec):
            out.append(p)
        elif isinstance(p, str):
            out.append(PromptSpec(p, SamplingParams(**defaults).validate()))
        else:
            d = dict(p)
            text, arrival, chat = d.pop("prompt"), d.pop("arrival", 0), d.pop("chat", False)
            out.append(PromptSpec(text, SamplingParams(**{**defaults, **d}).validate(), arrival, chat))
    return out


class Snapshot:
    """What the ``infertrace_snapshot`` fixture gives a test."""

    def __init__(self, golden_dir: Path, update: bool, announce: bool = False):
        self.golden_dir, self.update, self.announce = golden_dir, update, announce

    def path(self, name: str) -> Path:
        return self.golden_dir / name / "trace.json"

    def run(self, prompts: Sequence[Any], *, loaded: Any = None, model: str | Path | None = None, max_new_tokens: int = 2,
            settings: Any = None, show: Sequence[str] | None = None, layer: int = 0, engine: Any = None,
            **sampling: Any) -> Any:
        """Run the scenario and return its :class:`RunTrace` (attention pinned to torch unless set).

        ``settings``: an :class:`~infertrace.engine.options.EngineOptions` or a dict of its fields (the trace's
        ``options.settings``); ``engine`` is its old name, still taken.
        """
        from infertrace.engine.engine import EngineOptions
        from infertrace.runner import load_model, run_requests
        from infertrace.capture.recorder import VARIABLES

        if loaded is None:
            key = str(model or "")
            if key not in _MODELS:
                _MODELS[key] = load_model(model)
            loaded = _MODELS[key]
        settings = engine if settings is None else settings
        opts = settings if isinstance(settings, EngineOptions) else EngineOptions(**{"attention": "torch", **(settings or {})})
        specs = _specs(prompts, {"max_new_tokens": max_new_tokens, **sampling})
        return run_requests(loaded, specs, opts, layer=layer, show=tuple(show or VARIABLES),
                            options_for_record={"dtype": "float32", "device": "cpu"})

    def compare(self, name: str, trace: Any, *, atol: float | None = None, rtol: float | None = None,
                ignore: Sequence[str] = ()) -> None:
        """Compare ``trace`` with golden ``name`` (or write it under ``--infertrace-update``)."""
        from infertrace.trace.diff import DEFAULT_ATOL, DEFAULT_RTOL, diff_traces, format_diff
        from infertrace.trace.store import manifest_dict, read_manifest

        live = json.loads(golden_text(manifest_dict(trace)))
        p = self.path(name)
        if self.update:
            from infertrace.safe_io import write_output

            p.parent.mkdir(parents=True, exist_ok=True)
            # atomic; a FIFO, device node or directory at the golden's name is refused, never replaced
            write_output(p, golden_text(live).encode("utf-8"), force=True, option="golden trace", devices=False)
            if self.announce:  # listed at the end of the pytest run
                _WRITTEN.append(str(p))
            return
        if not p.is_file():
            pytest.fail(f"no golden trace {p}; create it with: pytest --infertrace-update (then review and commit it)", pytrace=False)
        golden = read_manifest(p.parent) if p.name == "trace.json" else _read_golden(p)  # bounded read + full schema check
        res = diff_traces(golden, live, DEFAULT_ATOL if atol is None else atol, DEFAULT_RTOL if rtol is None else rtol,
                          ignore=ignore)
        if not res.equal:
            lines = format_diff(res, golden, live, f"golden {p}", "this run")
            pytest.fail("\n".join([f"trace differs from golden '{name}'"] + lines
                                  + ["if the change is intended: pytest --infertrace-update <this test file>, review, commit"]),
                        pytrace=False)

    def check(self, name: str, prompts: Sequence[Any], *, atol: float | None = None, rtol: float | None = None,
              ignore: Sequence[str] = (), **run_kwargs: Any) -> Any:
        """:meth:`run` then :meth:`compare`; returns the trace."""
        trace = self.run(prompts, **run_kwargs)
        self.compare(name, trace, atol=atol, rtol=rtol, ignore=ignore)
        return trace


def _read_golden(p: Path) -> dict:
    """A golden file under another name: the same bounded, regular-file read and schema check."""
    import json as _json

    from infertrace.safe_io import MAX_MANIFEST_BYTES, parse_json, read_regular
    from infertrace.trace.store import validate_manifest

    try:
        d = parse_json(read_regular(p, MAX_MANIFEST_BYTES, "golden trace"), str(p))
    except _json.JSONDecodeError as e:
        pytest.fail(f"{p}: not valid JSON ({e.msg})", pytrace=False)
    return validate_manifest(d, str(p))  # upgraded to the current schema


@pytest.fixture
def infertrace_snapshot(request: pytest.FixtureRequest) -> Snapshot:
    """Golden-trace checker: ``infertrace_snapshot.check(name, prompts, loaded=..., settings={...})``."""
    cfg = request.config
    return Snapshot(Path(cfg.rootpath) / cfg.getini("infertrace_golden_dir"), bool(cfg.getoption("--infertrace-update")),
                    announce=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _WRITTEN:
        terminalreporter.write_line(f"infertrace: wrote {len(_WRITTEN)} golden trace(s):")
        for p in _WRITTEN:
            terminalreporter.write_line(f"  {p}")
