"""A speculative run's trace, end to end through the CLI on a tiny model: every claim of the
study's speculative-decoding table is in it (hidden [sum of (K+1), H], positions past + depth,
the verify mask in kq_mask rows and as TensorRT-LLM metadata, the KV rewind, several tokens per
target forward); it saves, loads back unchanged and passes ``infertrace check``; a tampered
verify row is caught; bad options are one-line errors."""

import json
from html.parser import HTMLParser

import pytest
from markupsafe import escape
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.trace.records import RunTrace
from infertrace.trace.store import load_trace, read_manifest
from tests.helpers.hostile import HTML_PAYLOAD, active_content
from tests.helpers.tiny import make_weights, write_gguf

ENV = {"COLUMNS": "120"}
PROMPT = "abcabcabcabcab"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    w, s = make_weights(seed=5, n_layer=3)
    return str(write_gguf(tmp_path_factory.mktemp("spectrace") / "m.gguf", w, s))


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


@pytest.fixture(scope="module", params=["cells", "paged"])
def saved(request, model_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("t") / request.param
    res = invoke("run", "--model", model_path, "--prompt", PROMPT, "--prompt", "xyz", "-n", "14", "--ignore-eos",
                 "--backend", request.param, "--tokens-per-block", "4", "--speculative", "draft", "--draft-layers", "1",
                 "--spec-tree=-1,-1,0,0,1,2", "--save", d, "--keep", "summary", "--show", "all")  # the panels the table claims are checked below
    assert res.exit_code == 0, res.output
    return request.param, d, res.output


def _verify_rows(m):
    return [(st, r) for st in m["steps"] for r in st["batch"] if r.get("spec")]


def test_trace_shows_every_claim_of_the_table(saved):
    backend, d, out = saved
    m = read_manifest(d)
    rows = _verify_rows(m)
    assert rows
    for st, r in rows:
        sp = r["spec"]
        depth = []
        for p in sp["parents"]:
            depth.append(0 if p < 0 else depth[p] + 1)
        assert r["positions"] == [r["C"] + x for x in depth]  # position is no longer one scalar: past + depth
        assert st["hidden"]["logical_shape"][0] == st["N"] >= r["T"] > 1  # hidden [sum of (K+1), H]
        assert len(sp["verify_mask"]) == r["T"] and sp["verify_mask"][0] == "1" + "0" * (r["T"] - 1)
        for i, row in enumerate(sp["verify_mask"]):  # ancestor relation
            anc, j = set(), i
            while j >= 0:
                anc.add(j)
                j = sp["parents"][j]
            assert row == "".join("1" if k in anc else "0" for k in range(r["T"]))
        if backend == "cells":
            assert sp["kq_mask_block"][1][0] == "0" and len(sp["cells"]) == r["T"]
            assert st["mask"]["kq_mask"] is not None
        else:
            assert sp["position_offsets"] == depth
            assert [w[0] for w in sp["packed_mask"]] == [int(x[::-1], 2) for x in sp["verify_mask"]]
        rw = sp["rewind"]
        assert rw["n_removed"] == r["T"] - len(sp["accepted_nodes"])
        assert r["cache_after"] == (f"0..{r['C'] + len(sp['accepted_nodes']) - 1}")
        assert st["spec"]["drafted"] >= sp["drafted"] and 0 <= st["spec"]["acceptance_rate"] <= 1
    assert any(len(r["spec"]["emitted"]) > 1 for _, r in rows)  # several tokens from one target forward
    assert any(r["spec"]["rejected_nodes"] for _, r in rows)  # and rejections, rewound
    if backend == "paged":
        assert any(r["spec"]["rewind"].get("moved_slots") for _, r in rows)  # an accepted branch moved into place
    assert m["spec"]["tokens_per_target_forward"] > 2  # two requests
    assert set(m["spec"]["requests"]) == {"0", "1"}
    assert m["options"]["settings"]["speculative"] == "draft" and m["options"]["settings"]["spec_tree"] == [-1, -1, 0, 0, 1, 2]
    # the terminal rendering marks accepted / rejected drafts, the verify mask and the rewind
    assert "✓" in out and "✗" in out and "verify mask" in out and "rewind" in out and "tokens per target forward" in out
    assert ("kq_mask rows of these" in out) if backend == "cells" else ("spec_decoding_packed_mask" in out)


def test_saved_trace_round_trips_and_passes_check(saved):
    backend, d, _ = saved
    m = read_manifest(d)
    tr = load_trace(d, timings=False)
    again = RunTrace.from_dict(json.loads(json.dumps(tr.to_dict())))
    assert again.to_dict() == tr.to_dict()
    assert tr.spec == m["spec"] and any(r.spec for st in tr.steps for r in st.batch)
    res = invoke("check", d)
    assert res.exit_code == 0, res.output
    assert "no violation" in res.output
    res = invoke("show", d, "--show", "mask,kv")
    assert res.exit_code == 0 and "verify mask" in res.output


def test_tampered_verify_row_is_caught(saved, tmp_path):
    _, d, _ = saved
    m = json.loads((d / "trace.json").read_text())
    st, r = _verify_rows(m)[0]
    r["positions"] = list(range(r["C"], r["C"] + r["T"]))  # as if the tree had been verified as a chain
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "trace.json").write_text(json.dumps(m))
    res = invoke("check", bad)
    assert res.exit_code != 0 and "C + depth" in res.output
    r["positions"] = [r["C"]] * r["T"]
    r["spec"]["accepted_nodes"] = [0, 5, 1]
    (bad / "trace.json").write_text(json.dumps(m))
    res = invoke("show", bad)
    assert res.exit_code == 2 and "accepted_nodes" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("args,msg", [(["--spec-tree=-1,0"], "error: --spec-tree: sets speculative decoding, which is off"),
                                      (["--speculative", "eagle"], "--speculative"),
                                      (["--speculative", "draft"], "error: --speculative: draft needs exactly one of draft_model (a path) or draft_layers (k)"),
                                      (["--speculative", "ngram", "--spec-tree=0"], "--spec-tree"),
                                      (["--speculative", "ngram", "--num-spec-tokens", "0"], "--num-spec-tokens"),
                                      # options that were silently ignored
                                      (["--speculative", "ngram", "--spec-tree", ""], "error: --spec-tree: must have 1..64 nodes (got 0)"),
                                      (["--ngram-min", "2"], "error: --ngram-min: sets speculative decoding, which is off"),
                                      (["--speculative", "draft", "--draft-layers", "1", "--ngram-max", "5"],
                                       "error: --ngram-min: ngram_min / ngram_max set the n-gram drafter; they need method ngram"),
                                      (["--speculative", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "1 <= min <= max")])
def test_bad_options_are_one_line_errors(model_path, args, msg):
    res = invoke("run", "--model", model_path, "--prompt", "ab", *args)
    assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output
    assert res.output.count("\n") == 1


class _Tables(HTMLParser):
    """Rows (cell texts) of every ``<table class="verify-mask">`` of a page, in order."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables, self._in, self._cell = [], False, None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and ("class", "verify-mask") in attrs:
            self._in = True
            self.tables.append([])
        elif self._in and tag == "tr":
            self.tables[-1].append([])
        elif self._in and tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag == "table":
            self._in = False
        elif self._in and tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(self._cell.strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def test_report_shows_every_verify_row(saved, tmp_path):
    """The HTML report draws each verify row's mask (■ = recorded verify_mask bit 1) with each node
    marked root / ✓ accepted / ✗ rejected, the worked-example cell marks, and the run's tokens per
    target forward; a hostile string in a spec field is escaped."""
    _, d, _ = saved
    m = json.loads((d / "trace.json").read_text())
    res = invoke("report", d, "-o", tmp_path / "r.html")
    assert res.exit_code == 0, res.output
    html = (tmp_path / "r.html").read_text(encoding="utf-8")
    p = _Tables()
    p.feed(html)
    rows = _verify_rows(m)
    assert len(p.tables) == len(rows) > 0
    rejected = 0
    for tab, (_, r) in zip(p.tables, rows):
        sp, T = r["spec"], r["T"]
        assert tab[0] == ["node"] + [str(j) for j in range(T)]
        for i, (cells, bits) in enumerate(zip(tab[1:], sp["verify_mask"], strict=True)):
            mark = "root" if i == 0 else "✓" if i in sp["accepted_nodes"] else "✗"
            assert cells == [f"{i} {mark}"] + ["■" if b == "1" else "·" for b in bits]
        rejected += len(sp["rejected_nodes"])
    assert rejected > 0  # the run has rejected drafts, so ✗ marks were checked
    assert f"tokens per target forward {m['spec']['tokens_per_target_forward']}" in html
    r = next(r for _, r in rows if len(r["spec"]["accepted_nodes"]) > 1 and r["spec"]["rejected_nodes"])
    worked = html[html.index('id="worked-example"'):html.index('id="cache-over-time"')]
    for j, t in enumerate(r["token_ids"][1:], 1):  # the worked-example cell marks each candidate
        assert f"{'✓' if j in r['spec']['accepted_nodes'] else '✗'}{t} " in worked
    assert f"+{len(r['spec']['emitted'])} · acc {r['spec']['accepted']}/{r['spec']['drafted']}" in worked
    # a hostile string in a spec field is escaped, never markup
    rows[0][1]["spec"]["rewind"]["op"] = HTML_PAYLOAD
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "trace.json").write_text(json.dumps(m))
    res = invoke("report", bad, "-o", tmp_path / "b.html")
    assert res.exit_code == 0, res.output
    page = (tmp_path / "b.html").read_text(encoding="utf-8")
    a = active_content(page)
    assert not a.handlers and not a.loaders and len(a.scripts) == 2
    assert escape(HTML_PAYLOAD) in page
