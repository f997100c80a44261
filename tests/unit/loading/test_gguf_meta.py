"""The GGUF header cache (:mod:`infertrace.loading.gguf_meta`): a cached header equals the one
gguf-py's ``GGUFReader`` gives (metadata, tokenizer values, tensor table and data views), the
tokenizer built from it equals the one built from the reader (tokens, merges, ids on a mixed
corpus), a changed file is re-read, and a corrupt or forged cache file is ignored.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest

from infertrace.loading.gguf_meta import cache_dir, load_header
from infertrace.tokenizer.vocab import Tokenizer
from infertrace.loading.weights import load_checkpoint, read_gguf
from tests.helpers.tiny import make_weights, write_gguf

CORPUS = [
    "Hello world", "def f(x):\n    return x * 2  # code", "你好，世界", "emoji 🎉🚀 and ZWJ 👩‍💻", "   runs   of    spaces",
    "<|im_start|>user\nhi<|im_end|>", "naïve café", "tab\tnew\nline", "", "1234567890 3.14159",
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("INFERTRACE_NO_CACHE", raising=False)
    return cache_dir()


def _entries(d):
    return sorted(d.glob("*.json")) if d.exists() else []


@pytest.mark.model
def test_cached_header_and_tokenizer_equal_gguf_reader(smol_path, cache):
    fresh, reader = load_header(smol_path, read_gguf)
    assert reader is not None and not fresh.from_cache and len(_entries(cache)) == 1
    hit, none = load_header(smol_path, read_gguf)
    assert none is None and hit.from_cache
    assert hit.display == fresh.display and hit.values == fresh.values and hit.n_tokens == fresh.n_tokens == 49152
    assert hit.tensors == fresh.tensors and hit.header_len == reader.data_offset
    by_name = {t.name: t for t in reader.tensors}
    for t in hit.tensors[:4] + hit.tensors[-2:]:
        a, b = by_name[t.name].data, hit.tensor_data(t)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    # the tokenizer from cached values = the tokenizer from gguf-py's reader
    t_ref, t_hit = Tokenizer.from_gguf(reader), Tokenizer.from_gguf(hit.values)
    assert t_hit._tokens == t_ref._tokens and t_hit._types == t_ref._types
    assert t_hit._backend.to_str() == t_ref._backend.to_str()  # vocab + merges + pre-tokenizer
    for name in ("bos_id", "eos_id", "eog_ids", "add_bos", "chat_template", "warnings", "vocab_size"):
        assert getattr(t_hit, name) == getattr(t_ref, name), name
    for text in CORPUS:
        ids = t_ref.encode(text)
        assert t_hit.encode(text) == ids and t_hit.decode(ids) == t_ref.decode(ids)
    assert t_hit.piece(ids[0]) == t_ref.piece(ids[0])
    # the whole checkpoint header (what inspect prints and the trace hashes) is the same
    a = load_checkpoint(smol_path, header_only=True)
    assert a.metadata == fresh.display and a.tokenizer.warnings == t_ref.warnings
    assert [(t.name, t.type, t.shape, t.n_bytes) for t in a.tensors] == [
        (t.name, gguf.GGMLQuantizationType(t.tensor_type).name, [int(x) for x in t.shape], int(t.n_bytes))
        for t in reader.tensors]


def test_changed_file_invalidates(tmp_path, cache):
    w, s = make_weights()
    path = write_gguf(tmp_path / "m.gguf", w, s)
    first, _ = load_header(path, read_gguf)
    assert load_header(path, read_gguf)[0].from_cache
    st = path.stat()
    # same size, same mtime, one header byte changed (the EOS id 258 -> 257): the header hash catches it
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.eos_token_id"
    i = data.index(key) + len(key) + 4  # after the key: u32 value type, then the u32 value
    assert int.from_bytes(data[i:i + 4], "little") == 258
    data[i:i + 4] = (257).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again, reader = load_header(path, read_gguf)
    assert reader is not None and not again.from_cache
    assert first.values["tokenizer.ggml.eos_token_id"] == 258 and again.values["tokenizer.ggml.eos_token_id"] == 257
    # a rewritten file (new mtime) is read again as well, and then cached
    write_gguf(path, w, s, theta=500000.0)
    third, reader = load_header(path, read_gguf)
    assert reader is not None and third.display["llama.rope.freq_base"] == 500000.0
    assert load_header(path, read_gguf)[0].from_cache


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong-types", "offset-outside-file", "bad-dtype",
                                    "other-sha", "tokens-length"])
def test_corrupt_cache_is_ignored(tmp_path, cache, damage):
    w, s = make_weights()
    path = write_gguf(tmp_path / "m.gguf", w, s)
    ref, _ = load_header(path, read_gguf)
    (entry,) = _entries(cache)
    text = entry.read_text()
    doc = json.loads(text)
    if damage == "garbage":
        entry.write_bytes(b"\x80\x04\x95 not json")  # e.g. a pickle someone dropped there: never loaded
    elif damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    else:
        if damage == "wrong-types":
            doc["tensors"][0]["n_bytes"] = "lots"
        elif damage == "offset-outside-file":
            doc["tensors"][0]["data_offset"] = path.stat().st_size
        elif damage == "bad-dtype":
            doc["tensors"][0]["np_dtype"] = "O"
        elif damage == "other-sha":
            doc["header_sha256"] = "0" * 64
        elif damage == "tokens-length":
            doc["values"]["tokenizer.ggml.tokens"] = doc["values"]["tokenizer.ggml.tokens"][:-1]
        entry.write_text(json.dumps(doc))
    back, reader = load_header(path, read_gguf)
    assert reader is not None and not back.from_cache  # re-parsed by gguf-py ...
    assert back.display == ref.display and back.values == ref.values and back.tensors == ref.tensors
    assert load_header(path, read_gguf)[0].from_cache  # ... and the entry rewritten


def test_cache_off_and_unwritable_dir(tmp_path, monkeypatch):
    w, s = make_weights()
    path = write_gguf(tmp_path / "m.gguf", w, s)
    monkeypatch.setenv("INFERTRACE_NO_CACHE", "1")
    assert cache_dir() is None and not load_header(path, read_gguf)[0].from_cache
    monkeypatch.delenv("INFERTRACE_NO_CACHE")
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache dir cannot be created: load still works
    h, reader = load_header(path, read_gguf)
    assert reader is not None and h.n_tokens == len(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)


def test_checkpoint_from_cache_equals_uncached(tmp_path, cache, monkeypatch):
    """Weights dequantised from memory-mapped views at cached offsets = weights via GGUFReader."""
    w, s = make_weights()
    path = write_gguf(tmp_path / "m.gguf", w, s)
    monkeypatch.setenv("INFERTRACE_NO_CACHE", "1")
    ref = load_checkpoint(path)
    monkeypatch.delenv("INFERTRACE_NO_CACHE")
    load_checkpoint(path)  # fills the cache
    hit = load_checkpoint(path)
    assert hit.metadata == ref.metadata and hit.config == ref.config and hit.tensors == ref.tensors
    assert hit.weights.keys() == ref.weights.keys()
    assert all(hit.weights[k].equal(ref.weights[k]) for k in ref.weights)
    assert hit.tokenizer.encode("hehe hello") == ref.tokenizer.encode("hehe hello")
