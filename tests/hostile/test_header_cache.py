"""A poisoned GGUF header cache entry (:mod:`infertrace.loading.gguf_meta`): an entry whose content
was edited after it was written still carries the file's header digest, so every hit is compared
with the file's own header bytes (:mod:`infertrace.loading.gguf_cache_verify`). A poisoned entry is
a miss: gguf-py parses the file again and the result is gguf-py's, never the entry's.

The reference values are gguf-py's own ``GGUFReader`` of the same file, read directly.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.loading.gguf_meta import cache_dir, load_header
from infertrace.loading.weights import read_gguf
from tests.helpers.tiny import make_weights, write_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("INFERTRACE_NO_CACHE", raising=False)
    return cache_dir()


def _q8_embd(name, arr):
    """Store the token embedding as Q8_0 (a quantised tensor whose type matters)."""
    if name == "token_embd.weight":
        return gguf.quants.quantize(arr, Q.Q8_0), Q.Q8_0
    return None


@pytest.fixture
def model(tmp_path):
    w, s = make_weights(seed=3)
    return write_gguf(tmp_path / "m.gguf", w, s, quant=_q8_embd)


def _poison(cache, fn):
    (entry,) = sorted(cache.glob("*.json"))
    doc = json.loads(entry.read_text())
    fn(doc)
    entry.write_text(json.dumps(doc))
    return doc


def _embd(doc):
    return next(t for t in doc["tensors"] if t["name"] == "token_embd.weight")


def _type_only(doc):  # the case of issue 31 item 14: one tensor's type changed, nothing else
    t = _embd(doc)
    t["type_id"], t["type_name"] = int(Q.Q4_0), "Q4_0"


def _type_forged(doc):  # the same change made self-consistent: bytes, numpy view and offsets all agree
    t = _embd(doc)
    ne0, rows = t["shape"]
    t.update(type_id=int(Q.Q4_0), type_name="Q4_0", n_bytes=rows * ne0 // 32 * 18, np_shape=[rows, ne0 // 32 * 18])


def _shape(doc):  # two dims swapped, same byte count (passes every bounds check of the reader)
    t = next(t for t in doc["tensors"] if t["name"] == "blk.0.ffn_up.weight")
    assert t["shape"][0] != t["shape"][1]
    t["shape"], t["np_shape"] = t["shape"][::-1], t["np_shape"][::-1]


def _offset(doc):  # two tensors' data swapped (both F32 of one shape): silent wrong weights
    a, b = (t for t in doc["tensors"] if t["name"] in ("blk.0.attn_q.weight", "blk.0.attn_output.weight"))
    a["data_offset"], b["data_offset"] = b["data_offset"], a["data_offset"]


def _token(doc):  # the tokenizer's vocabulary edited: encode/decode would change
    doc["values"]["tokenizer.ggml.tokens"][5] = "POISON"


def _eos(doc):  # a tokenizer id changed
    doc["values"]["tokenizer.ggml.eos_token_id"] = 3


def _theta(doc):  # a hyper-parameter that changes every rotation
    key = next(k for k in doc["display"] if k.endswith("rope.freq_base"))
    doc["display"][key] = 12345.0


def _extra_key(doc):  # a key the file does not have
    doc["display"]["llama.rope.scaling.factor"] = 8.0


POISONS = {"type-only": _type_only, "type-forged": _type_forged, "shape": _shape, "offset": _offset,
           "token": _token, "eos": _eos, "theta": _theta, "extra-key": _extra_key}


@pytest.mark.parametrize("name", list(POISONS))
def test_poisoned_entry_is_reparsed_to_gguf_readers_header(model, cache, name):
    first, reader = load_header(model, read_gguf)
    assert reader is not None and load_header(model, read_gguf)[0].from_cache  # a valid entry is a hit
    _poison(cache, POISONS[name])
    back, reader = load_header(model, read_gguf)
    assert reader is not None and not back.from_cache, "the poisoned entry was used"
    ref = gguf.GGUFReader(str(model))  # gguf-py's own reading of the file
    embd = next(t for t in ref.tensors if t.name == "token_embd.weight")
    assert Q(embd.tensor_type) == Q.Q8_0
    got = {t.name: t for t in back.tensors}
    for t in ref.tensors:
        g = got[t.name]
        assert (g.type_id, g.shape, g.data_offset, g.n_bytes) == (int(t.tensor_type), [int(x) for x in t.shape],
                                                                   int(t.data_offset), int(t.n_bytes))
    tokens = [bytes(ref.fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in ref.fields["tokenizer.ggml.tokens"].data]
    assert back.values["tokenizer.ggml.tokens"] == tokens
    assert back.values["tokenizer.ggml.eos_token_id"] == ref.fields["tokenizer.ggml.eos_token_id"].contents()
    assert set(back.display) == set(ref.fields)
    again = load_header(model, read_gguf)[0]  # the entry was rewritten from the file: a hit again
    assert again.from_cache and again.tensors == back.tensors


def test_poisoned_type_runs_as_the_uncached_file(model, cache, tmp_path, monkeypatch):
    """Through the CLI: the run with a poisoned entry (one type changed; before: an internal error,
    exit 1) gives the same tokens as a run with the cache off."""
    run = ["run", "--model", str(model), "--prompt", "ab", "--max-new-tokens", "2", "--json"]
    assert CliRunner().invoke(app, ["inspect", str(model)]).exit_code == 0  # writes the entry
    _poison(cache, _type_only)
    res = CliRunner().invoke(app, run)
    assert res.exit_code == 0, res.output
    monkeypatch.setenv("INFERTRACE_NO_CACHE", "1")
    ref = CliRunner().invoke(app, run)
    assert ref.exit_code == 0, ref.output
    out, want = json.loads(res.stdout), json.loads(ref.stdout)
    assert out["requests"][0]["output_ids"] == want["requests"][0]["output_ids"]


def test_valid_entry_with_float_arrays_and_bools_still_hits(tmp_path, cache):
    """The verification re-encodes values exactly: a valid entry with float32 arrays, bools, strings
    and unicode is still a hit (the cache keeps working)."""
    w, s = make_weights(seed=4)
    p = write_gguf(tmp_path / "u.gguf", w, s, kv={"note": "naïve ☃", "flag": True, "ratio": 0.1})
    first, _ = load_header(p, read_gguf)
    hit, reader = load_header(p, read_gguf)
    assert reader is None and hit.from_cache and hit.display == first.display and hit.values == first.values
    assert np.float32(hit.display["llama.ratio"]) == np.float32(0.1)
