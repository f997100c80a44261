"""Hostile variants of the golden traces (cases X1, X2 of ../shared/cases.md), shared by
tests/hostile/test_trace_files.py and tests/fuzz/.

A *field pattern* is a path through trace.json with list indices replaced by ``*`` and seq_id
keys by ``#``; :func:`variants` yields one trace per pattern with every leaf of that pattern
(string or number) replaced by a payload, so every string and number field is attacked.
"""

from __future__ import annotations

import copy
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Callable, Iterator

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden"

#: sets an attribute whose name is assembled at run time: ``data-xss="1"`` in the DOM means a script ran
_JS = "document.documentElement.setAttribute('data-x'+'ss','1')"
HTML_PAYLOAD = (f"\"'></p></td></text></title></svg><img src=x onerror=\"{_JS}\"><script>{_JS}</script>"
                f"</script><script>{_JS}</script><!--<svg/onload={_JS}>]]>")
ATTR_PAYLOAD = f"0\" onmouseover=\"{_JS}\" x=\""
#: OSC 52 clipboard write, clear screen, CSI as a C1 byte, DEL, a bidi override, Rich markup
TERM_PAYLOAD = "\x1b]52;c;SGVsbG8=\x07\x1b[2J\x9b31m\x7f\u202e[bold red]markup[/bold red][/]\x00"
BAD_TERMINAL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def load(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / name / "trace.json").read_text(encoding="utf-8"))


def _walk(x: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, path + ("#" if k.isdigit() else k,))
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v, path + ("*",))
    elif isinstance(x, (str, int, float)) and not isinstance(x, bool):
        yield path, x


def patterns(d: dict[str, Any]) -> list[tuple[tuple, str]]:
    """Distinct ``(pattern, type name)`` of the string and number leaves, in a stable order."""
    return sorted({(p, type(v).__name__) for p, v in _walk(d, ())}, key=lambda t: (t[0], t[1]))


def replace_all(x: Any, pattern: tuple, fn: Callable[[Any], Any], path: tuple = ()) -> Any:
    """Copy of ``x`` with every leaf on ``pattern`` replaced by ``fn(leaf)``."""
    if len(path) == len(pattern):
        return fn(x) if isinstance(x, (str, int, float)) and not isinstance(x, bool) else x
    want = pattern[len(path)]
    if isinstance(x, dict):
        return {k: (replace_all(v, pattern, fn, path + (want,)) if (want == "#" and k.isdigit()) or k == want else v)
                for k, v in x.items()}
    if isinstance(x, list) and want == "*":
        return [replace_all(v, pattern, fn, path + ("*",)) for v in x]
    return x


def variants(name: str, string_payload: str, number_payload: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """One hostile trace per field pattern of golden ``name`` (plus hostile extra keys)."""
    d = load(name)
    for pat, kind in patterns(d):
        payload = string_payload if kind == "str" else number_payload
        yield "/".join(pat) + f" ({kind})", replace_all(d, pat, lambda _v: payload)
    e = copy.deepcopy(d)
    e["config"][string_payload[:60]] = string_payload
    e["options"]["settings"][string_payload[:60]] = string_payload
    yield "extra keys", e


def write_trace(d: dict[str, Any], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trace.json").write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
    return directory


class ActiveContent(HTMLParser):
    """Collects what could run in a page: event-handler attributes, script elements (with their
    text), javascript: URLs, elements that load things (img, iframe, object, embed, link, meta refresh)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.handlers: list[str] = []
        self.scripts: list[str] = []
        self.loaders: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for k, v in attrs:
            if k.lower().startswith("on"):
                self.handlers.append(f"<{tag} {k}>")
            if v and "javascript:" in v.replace(" ", "").lower() and k.lower() in ("href", "src", "action", "xlink:href"):
                self.handlers.append(f"<{tag} {k}={v}>")
        if tag in ("img", "iframe", "object", "embed", "link", "base", "form") or (tag == "meta" and any(k == "http-equiv" for k, _ in attrs)):
            self.loaders.append(tag)
        if tag == "script":
            self._in_script = True
            self.scripts.append("")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag == "script":
            self._in_script = False

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts[-1] += data


def active_content(html: str) -> ActiveContent:
    p = ActiveContent()
    p.feed(html)
    p.close()
    return p


def spec_verify_rows(d: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(step, batch row)`` of every speculative verify row of a trace dict."""
    return [(st, r) for st in d["steps"] for r in st["batch"] if r.get("spec")]


def spec_variants(d: dict[str, Any], string_payload: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """Hostile speculative traces made from a real one ``d`` (``run --speculative ... --save``):
    ``(label, trace, expect)``. ``expect`` is ``"refuse"`` (exit 2 on load: a wrong type, a
    negative count, NaN, a rate over 1, a wrong-typed spec object), ``"violation"`` (loads, but
    ``check`` must report it: a mask / count / tree inconsistent with the row's tree) or ``"any"``
    (every leaf of a spec field set to the string / number / container payloads: exit 0/1/2)."""
    for pat, _kind in patterns(d):
        if "spec" not in pat:
            continue
        for pay in (string_payload, -1, 10**30, float("nan"), [], {}, None):
            yield f"{'/'.join(pat)} = {type(pay).__name__}", replace_all(d, pat, lambda _v, p=pay: p), "any"
    for where in ("row", "step", "run"):
        for pay in ([], string_payload, 5, [[1]] * 5000):
            e = copy.deepcopy(d)
            st, r = spec_verify_rows(e)[0]
            {"row": r, "step": st, "run": e}[where]["spec"] = pay
            yield f"{where}.spec = {type(pay).__name__}", e, "refuse"

    def row(label: str, expect: str, fn: Callable[[dict, dict, dict], Any]) -> tuple[str, dict[str, Any], str]:
        e = copy.deepcopy(d)
        st, r = spec_verify_rows(e)[-1]
        fn(st, r, e)
        return label, e, expect

    def sp(**kw: Any) -> Callable[[dict, dict, dict], Any]:
        return lambda st, r, e: r["spec"].update(kw)

    T = spec_verify_rows(d)[-1][1]["T"]
    yield row("verify_mask one row", "violation", sp(verify_mask=["1"]))
    yield row("verify_mask all ones", "violation", sp(verify_mask=["1" * T] * T))
    yield row("verify_mask 4096 x 4096", "violation", sp(verify_mask=["1" * 4096] * 4096))
    yield row("verify_mask payload", "violation", sp(verify_mask=[string_payload[:200]] * T))
    yield row("kq_mask_block 1 x 1", "violation", sp(kq_mask_block=[["0"]]))
    yield row("packed_mask no words", "violation", sp(packed_mask=[[]] * T))
    yield row("packed_mask zero", "violation", sp(packed_mask=[[0]] * T))
    yield row("position_offsets flat", "violation", sp(position_offsets=[0] * T))
    yield row("accepted > drafted", "violation", sp(accepted=50, drafted=T - 1))
    yield row("drafted wrong", "violation", sp(drafted=T + 7))
    yield row("rejected out of range", "violation", sp(rejected_nodes=[4000]))
    yield row("emitted none", "violation", sp(emitted=[], emitted_pieces=[]))
    yield row("emitted 4096", "violation", sp(emitted=[1] * 4096, emitted_pieces=[string_payload[:40]] * 4096))
    yield row("parents not a tree", "violation", sp(parents=[-1] + [T] * (T - 1)))
    yield row("accepted path 4096", "violation", sp(accepted_nodes=[0] * 4096))
    yield row("spec on a prefill row", "violation", lambda st, r, e: e["steps"][0]["batch"][0].update(spec=copy.deepcopy(r["spec"])))
    yield row("run tree not a tree", "violation", lambda st, r, e: e["spec"].update(tree=[5, 5, 5]))
    yield row("run tokens per forward inf", "violation", lambda st, r, e: e["spec"].update(tokens_per_target_forward=float("inf")))
    yield row("accepted negative", "refuse", sp(accepted=-5))
    yield row("step rate NaN", "refuse", lambda st, r, e: st["spec"].update(acceptance_rate=float("nan")))
    yield row("step rate 9", "refuse", lambda st, r, e: st["spec"].update(accepted=9, drafted=1, acceptance_rate=9.0))
    yield row("rewind slot negative", "refuse", sp(rewind={"op": string_payload, "moved_slots": [[10**9, -1]]}))
    yield row("rewind a list", "refuse", sp(rewind=[1, 2]))
