"""``infertrace check`` on the newer trace sections (issue 23 item 7 and item 9's display fields;
cases X7, X8): every unmodified trace the tool writes passes (plain, serving, speculative, prefix
cache, context shift, hybrid, Gemma 3 sliding window on both backends, llama.cpp engine), and each
field-by-field mutant of a real trace is caught — exit 1 with a violation naming it, or exit 2 when
the schema refuses it (then ``show`` refuses it too). The window, visibility, verify cells and
cache ranges are recomputed from positions, seq ids and the config's window, so a mutant is caught
whichever copy of the fact it changes. A trace saved with tensors is read whole: a tensor file that
disagrees with the records is a violation, a truncated one unreadable (exit 2)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

import pytest

from tests.helpers.tiny import make_weights, write_gguf
from tests.helpers.mutation import assert_mutant_caught, invoke, load_manifest as _load, tampered as _tampered
from tests.helpers.tiny_qwen35 import make_weights as make_q35, write_hf_dir

# the same runs as the README's kinds of trace, on tiny models (tests/helpers/tiny.py): the prompt of the Gemma
# runs is longer than the window W = 4, so the window really cuts keys on the windowed layers 0..4
RUNS: dict[str, tuple[str, list[str]]] = {
    # --ctx-size 2048 stated: the tiny model's trained context (256) would lower the default, and a mutant below
    # names the cells' size 2048
    "plain": ("llama", ["-p", "abcdefgh", "-p", "xyz", "-n", "3", "--ctx-size", "2048"]),
    "serving": ("llama", ["-p", "abcdefgh", "-p", "xy", "-p", "hello", "--arrival", "0", "--arrival", "1", "--arrival", "2",
                          "-n", "4", "--backend", "paged", "--tokens-per-block", "2", "--num-blocks", "8"]),
    "spec-cells": ("llama", ["-p", "abcabcabcabcab", "-p", "xyz", "-n", "8", "--speculative", "draft", "--draft-layers", "1",
                             "--spec-tree=-1,-1,0,0,1,2"]),
    "spec-paged": ("llama", ["-p", "abcabcabcabcab", "-n", "8", "--backend", "paged", "--tokens-per-block", "4",
                             "--speculative", "draft", "--draft-layers", "1", "--spec-tree=-1,-1,0,0,1,2"]),
    "prefix-cells": ("llama", ["-p", "HelloWorld", "-p", "HelloWorld", "--arrival", "0", "--arrival", "3", "-n", "3",
                               "--prefix-cache", "on", "--tokens-per-block", "4"]),
    "prefix-paged": ("llama", ["-p", "HelloWorld", "-p", "HelloWorld", "--arrival", "0", "--arrival", "3", "-n", "3",
                               "--prefix-cache", "on", "--backend", "paged", "--tokens-per-block", "4"]),
    "shift": ("llama", ["-p", "abcde", "-n", "10", "--ctx-size", "12", "--context-shift"]),
    "hybrid": ("qwen35", ["-p", "hello", "-n", "3", "--backend", "paged"]),
    "gemma-cells": ("gemma3", ["-p", "abcdefgh", "-p", "xyz", "-n", "4"]),
    "gemma-paged": ("gemma3", ["-p", "abcdefgh", "-p", "xy", "-n", "4", "--backend", "paged", "--tokens-per-block", "4"]),
    "gemma-shift": ("gemma3", ["-p", "abcdefgh", "-n", "8", "--ctx-size", "12", "--context-shift"]),
    "gemma-spec": ("gemma3", ["-p", "abcabcabcabcab", "-n", "6", "--speculative", "draft", "--draft-layers", "1",
                              "--spec-tree=-1,-1,0,0,1,2"]),
    "llamacpp": ("llama", ["-p", "abcdefgh", "-p", "xy", "-n", "3", "--runtime", "llama.cpp"]),
    "summary": ("llama", ["-p", "abcdefgh", "-n", "2", "--keep", "summary"]),
    # far positions: pos 700 * inv_freq 0.75 (head_dim 64) is an angle float32 rounds by ~3e-5
    # (--ctx-size stated: the tiny model's trained context, 256, would be the default and refuse the 700-token prompt)
    "far": ("wide", ["-p", "abcdefghij" * 70, "-n", "3", "--keep", "summary", "--ctx-size", "1024"]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    w, s = make_weights(seed=5, n_layer=3)
    out = {"llama": write_gguf(root / "l.gguf", w, s)}
    w, s = make_weights(family="gemma3", n_layer=6, seed=5)  # Gemma 3 pattern: layers 0..4 windowed, 5 global
    out["gemma3"] = write_gguf(root / "g.gguf", w, s, kv={"attention.sliding_window": 4, "final_logit_softcapping": 3.0})
    w, s = make_q35(seed=2)
    out["qwen35"] = write_hf_dir(root / "q35", w, s)
    w, s = make_weights(seed=5, n_layer=1, H=128, head_dim=64, n_head=2, n_kv=1)
    out["wide"] = write_gguf(root / "w.gguf", w, s)
    return out


@pytest.fixture(scope="module")
def traces(models, tmp_path_factory) -> Callable[[str], Path]:
    root, made = tmp_path_factory.mktemp("traces"), {}

    def get(kind: str) -> Path:
        if kind not in made:
            model, args = RUNS[kind]
            res = invoke("run", "-m", models[model], "--ignore-eos", *args, "--save", root / kind)
            assert res.exit_code == 0, res.output[-800:]
            made[kind] = root / kind
        return made[kind]
    return get




@pytest.mark.parametrize("kind", [k for k in RUNS])
def test_every_trace_the_tool_writes_passes_check(traces, kind):
    res = invoke("check", traces(kind))
    assert res.exit_code == 0, res.output
    assert res.output.startswith("ok: ") and "no violation" in res.output
    # what was read is said: the tensor file too when the run kept tensors (the default)
    assert ("read trace.json (saved with --keep summary: no tensors)" in res.output) == (kind in ("summary", "far")), res.output
    if kind not in ("summary", "far"):
        assert "read trace.json + tensors.safetensors (" in res.output, res.output


def test_llamacpp_engine_on_windowed_layers_passes_check(models, tmp_path):
    """llama.cpp keeps windowed layers in a second cache (llama_kv_cache_iswa) and names both masks
    attn_inp_kq_mask; the capture tells them apart by the consuming layer (kv/iswa.py mirrors the pool), so a
    llama.cpp trace of a windowed model records visible = 0..p and visible_swa = p-W+1..p, and ``check`` passes
    it (before, the windowed mask was recorded as the global one and ``check`` refused it)."""
    d = tmp_path / "t"
    res = invoke("run", "-m", models["gemma3"], "--ignore-eos", "-p", "abcdefgh", "-n", "3", "--runtime", "llama.cpp",
                 "--save", d)
    assert res.exit_code == 0, res.output
    chk = invoke("check", d)
    assert chk.exit_code == 0, chk.output


def _row(d: dict, step: int = 0, seq: int = 0) -> dict:
    st = next(s for s in d["steps"] if s["step"] == step)
    return next(r for r in st["batch"] if r["seq_id"] == seq)


def _swa(d: dict, step: int = 0) -> dict:
    return next(s for s in d["steps"] if s["step"] == step)["mask"]["swa"]


def _both_visible_swa(d: dict, seq: int, i: int, keys: str) -> None:
    """Change query i's windowed keys in the row and in mask.swa.visible alike (no copy disagrees)."""
    _row(d, 0, seq)["visible_swa"][i] = keys
    q = next(v for v in _swa(d)["visible"] if v["seq_id"] == seq)["queries"][i]
    q["keys"] = keys


def _all_visible_swa_as_visible(d: dict) -> None:
    for st in d["steps"]:
        for r in st["batch"]:
            r["visible_swa"] = list(r["visible"])
        st["mask"]["swa"]["visible"] = copy.deepcopy(st["mask"]["visible"])


def _kq_swa_flip(d: dict, row: int, want: str) -> None:
    """Flip the first entry of kq_mask_swa row ``row`` whose value is not ``want`` and whose cell
    (pos > 0) is of the query's sequence outside (want "0") or inside (want "-inf") the window."""
    sw = _swa(d)
    kq = sw["kq_mask_swa"]
    qpos = 7  # gemma-cells step 0 row 7: seq 0 at pos 7, window 4..7
    for c, x in enumerate(kq["rows"][row]):
        p = kq["cell_pos"][c]
        inside = 4 <= p <= 7
        if x != want and p >= 0 and (inside if want == "-inf" else (p < 4)) and c < 8:
            kq["rows"][row][c] = want
            return
    raise AssertionError(f"no entry to flip for query pos {qpos}")


def _spec_row(d: dict) -> dict:
    return next(r for st in d["steps"] for r in st["batch"] if (r.get("spec") or {}).get("cells"))


def _same_cell(d: dict) -> None:
    sp = _spec_row(d)["spec"]
    sp["cells"] = [sp["cells"][0]] * len(sp["cells"])


def _swap_cells(d: dict) -> None:  # the root (accepted: it must keep pos C) and a draft node trade cells
    sp = _spec_row(d)["spec"]
    sp["cells"][0], sp["cells"][1] = sp["cells"][1], sp["cells"][0]


def _layer_types(d: dict, value) -> None:
    d["config"]["layer_types"] = value


# kind, mutation, exit codes allowed, a phrase the one line must carry
def _feed_other(d: dict) -> None:  # step 2 feeds seq 0 token 7, not step 1's choice (its hidden row agrees)
    _row(d, 2).update(token_ids=[7])
    d["steps"][2]["hidden"]["rows"][0].update(token_id=7)


MUTANTS: dict[str, tuple[str, Callable[[dict], None], tuple[int, ...], str]] = {
    # Gemma 3 sliding window (X7)
    "windowed keys past the window": ("gemma-cells", lambda d: _both_visible_swa(d, 0, 7, "3..7"), (1,),
                                      "window: query pos 7 sees keys '3..7' on the windowed layers, expected 4..7"),
    "windowed keys past its own position": ("gemma-cells", lambda d: _both_visible_swa(d, 0, 6, "3..7"), (1,),
                                            "window: query pos 6 sees keys '3..7' on the windowed layers, expected 3..6"),
    "row visible_swa only": ("gemma-cells", lambda d: _row(d)["visible_swa"].__setitem__(7, "0..7"), (1,), "expected 4..7"),
    "visible_swa equal to visible": ("gemma-cells", _all_visible_swa_as_visible, (1,),
                                     "query pos 4 sees keys '0..4' on the windowed layers, expected 1..4"),
    "visible_swa missing": ("gemma-cells", lambda d: _row(d).update(visible_swa=None), (1,), "visible_swa is missing"),
    "swa.layers out of range": ("gemma-cells", lambda d: _swa(d).update(layers=[0, 1, 2, 3, 4, 99]), (1, 2), "layers"),
    "swa.layers a global layer": ("gemma-cells", lambda d: _swa(d).update(layers=[0, 1, 2, 3, 4, 5], global_layers=[]),
                                  (1,), "mask.swa.layers is [0, 1, 2, 3, 4, 5] but the config gives [0, 1, 2, 3, 4]"),
    "n_swa 0": ("gemma-cells", lambda d: _swa(d).update(n_swa=0), (1, 2), "n_swa"),
    "n_swa 3": ("gemma-cells", lambda d: _swa(d).update(n_swa=3), (1,), "mask.swa.n_swa is 3 but the config gives 4"),
    "config window 3": ("gemma-cells", lambda d: d["config"].update(sliding_window=3), (1,),
                        "query pos 3 sees keys '0..3' on the windowed layers, expected 1..3 (keys p-W+1..p, W = 3)"),
    "config swa_layers short": ("gemma-cells", lambda d: d["config"].update(swa_layers=[True, True]), (1, 2), "swa_layers"),
    "kq_mask_swa a row short": ("gemma-cells", lambda d: _swa(d)["kq_mask_swa"]["rows"].pop(), (1,), "kq_mask_swa"),
    "kq_mask_swa a row more": ("gemma-cells", lambda d: _swa(d)["kq_mask_swa"]["rows"].append(["-inf"] * 16), (1,),
                               "kq_mask_swa"),
    "kq_mask_swa ragged": ("gemma-cells", lambda d: _swa(d)["kq_mask_swa"]["rows"][0].append("-inf"), (1,), "kq_mask_swa"),
    "kq_mask_swa keeps a key past the window": ("gemma-cells", lambda d: _kq_swa_flip(d, 7, "0"), (1,),
                                                "outside the window 4..7 (W = 4)"),
    "kq_mask_swa hides a key in the window": ("gemma-cells", lambda d: _kq_swa_flip(d, 7, "-inf"), (1,),
                                              "inside the window 4..7 (W = 4)"),
    "physical n_swa": ("gemma-cells", lambda d: d["steps"][0]["kv"]["physical"].update(n_swa=2), (1,), "kv.physical n_swa 2"),
    "paged attention_window": ("gemma-paged", lambda d: d["steps"][1]["kv"]["physical"]["attention_window"].update({"5": 4}),
                               (1,), "attention_window"),
    "paged visible_swa": ("gemma-paged", lambda d: _row(d, 1, 0).__setitem__("visible_swa", ["0..8"]), (1,),
                          "expected 5..8"),
    "spec windowed keys": ("gemma-spec", lambda d: _spec_row(d).__setitem__("visible_swa", list(_spec_row(d)["visible"])),
                           (1,), "on the windowed layers"),
    # speculative verify cells (X8)
    "every draft node in the same cell": ("spec-cells", _same_cell, (1, 2), "distinct"),
    "two draft nodes' cells swapped": ("spec-cells", _swap_cells, (1,), "verify cells"),
    "gemma draft nodes in one cell": ("gemma-spec", _same_cell, (1, 2), "distinct"),
    "rewind frees other cells": ("spec-cells", lambda d: _spec_row(d)["spec"]["rewind"].update(freed="0..5"), (1,),
                                 "the rewind frees cells"),
    # hybrid layer map (X8)
    "layer_types too long": ("hybrid", lambda d: _layer_types(d, d["config"]["layer_types"] + ["full_attention"]), (1, 2),
                             "layer_types"),
    "layer_types too short": ("hybrid", lambda d: _layer_types(d, d["config"]["layer_types"][:2]), (1, 2), "layer_types"),
    "layer_types unknown type": ("hybrid", lambda d: _layer_types(d, ["mamba"] * 4), (2,), "is not one of"),
    "layer_types disagree with the layer map": ("hybrid", lambda d: _layer_types(d, ["full_attention", "linear_attention"] * 2),
                                                (1,), "layer"),
    "n_layer disagrees": ("hybrid", lambda d: d["config"].update(n_layer=5), (1, 2), "n_layer"),
    # display fields (item 9)
    "cache_after beyond the limit": ("plain", lambda d: _row(d).update(cache_after="0..99999999"), (1,),
                                     "cache_after is '0..99999999' but the request holds positions 0..7 after the step"),
    "cache_before shifted": ("plain", lambda d: _row(d, 1).update(cache_before="1..8"), (1,), "cache_before"),
    "hidden row token not the packed token": ("plain", lambda d: d["steps"][0]["hidden"]["rows"][2].update(token_id=250), (1,),
                                              "hidden row 2"),
    "num_blocks disagrees with the pool": ("serving", lambda d: d["options"]["settings"].update(num_blocks=9), (1,),
                                           "kv.physical.num_blocks is 8 but the run's options give 9"),
    "ctx_size disagrees with the cells": ("plain", lambda d: d["options"]["settings"].update(ctx_size=4096), (1,),
                                          "kv.physical.size is 2048"),
    "used cells": ("plain", lambda d: d["steps"][0]["kv"]["physical"].update(used=3), (1,), "used = 3"),
    "global visible with a gap": ("plain", lambda d: _row(d)["visible"].__setitem__(3, "0,2..3"), (1,),
                                  "query pos 3 sees keys '0,2..3', expected 0..3"),
    "kq_mask hides an earlier key": ("plain", lambda d: d["steps"][0]["mask"]["kq_mask"]["rows"][3].__setitem__(1, "-inf"),
                                     (1,), "kq_mask row 3 (pos 3) hides cell 1"),
    "RoPE sin off by 1e-3 at a far position": ("far", lambda d: d["steps"][1]["positions"]["cos_sin"][0]["sin"].__setitem__(
        1, d["steps"][1]["positions"]["cos_sin"][0]["sin"][1] + 1e-3), (1,), "RoPE angle consistent with position: pos 700 pair 1"),
    # the decode loop (greedy choice, the token fed next, the request's ids)
    "greedy chose a token other than the top": ("plain", lambda d: d["steps"][1]["decode"]["per_request"][0].update(
        chosen=d["steps"][1]["decode"]["per_request"][0]["top"][1]["id"]), (1,), "greedy chooses the top logit"),
    "next_input not the chosen token": ("plain", lambda d: d["steps"][1]["decode"]["per_request"][0].update(next_input=7),
                                        (1,), "next_input 7 but chosen"),
    "next_pos not the next position": ("plain", lambda d: d["steps"][1]["decode"]["per_request"][0].update(next_pos=12), (1,),
                                       "next_pos 12 but the sequence holds positions 0..8 after the step"),
    "chosen token not fed next": ("plain", _feed_other, (1,), "the step's first token is 7 but the previous step chose 150"),
    "output_ids not the chosen tokens": ("plain", lambda d: d["requests"][0]["output_ids"].__setitem__(2, 7), (1,),
                                         "output_ids are the chosen tokens"),
    "output id past the vocabulary": ("plain", lambda d: d["requests"][0]["output_ids"].__setitem__(2, 259), (1, 2),
                                      "259"),
    "prompt id past the vocabulary": ("plain", lambda d: d["requests"][1]["prompt_ids"].__setitem__(0, 100000), (1, 2),
                                      "100000"),
    "prompt_ids not the prefill tokens": ("plain", lambda d: d["requests"][0]["prompt_ids"].__setitem__(1, 7), (1,),
                                          "are not prompt_ids + output_ids there"),
    "position_ids disagree with the batch": ("plain", lambda d: d["steps"][1]["positions"].update(position_ids=[9, 3]), (1,),
                                             "position_ids"),
    "spec verify rows with speculative off": ("spec-cells", lambda d: d["options"]["settings"].update(speculative=None), (1, 2),
                                              "speculative"),
    "draft_layers not below n_layer": ("spec-cells", lambda d: d["options"]["settings"].update(draft_layers=3), (1, 2),
                                       "draft_layers"),
    "hybrid inp_pos disagrees with the batch": ("hybrid", lambda d: d["steps"][1]["hybrid"]["positions"].update(
        inp_pos=[5, 5, 5, 0]), (1, 2), "inp_pos"),
    "n_layer disagrees with the cache's layers": ("plain", lambda d: d["config"].update(n_layer=2), (1, 2),
                                                  "kv.layers 3 but config.n_layer 2"),
    "options.layer past n_layer": ("plain", lambda d: d["options"].update(layer=3), (1, 2), "options.layer 3"),
    # the tensor file is read too
    "recorded hidden value": ("plain", lambda d: d["steps"][0]["hidden"]["rows"][0]["first"].__setitem__(
        0, d["steps"][0]["hidden"]["rows"][0]["first"][0] + 0.01), (1,), "step0/hidden[0, 0]"),
    "recorded cache value": ("plain", lambda d: d["steps"][1]["kv"]["layer_view"]["requests"][0]["rows"][0]["k"].__setitem__(
        0, 5.0), (1,), "kv.layer_view k of pos 8[0] = 5.0 but step1/layer0/seq0/k_cache[8, 0, 0]"),
}


@pytest.mark.parametrize("case", list(MUTANTS))
def test_mutant_is_caught(traces, tmp_path, case):
    kind, mutate, codes, phrase = MUTANTS[case]
    assert_mutant_caught(traces(kind), mutate, codes, phrase, tmp_path)


def test_schema_refuses_what_cannot_be_consistent(traces, tmp_path):
    """The self-contradictions are refused by the schema itself (show: exit 2), not only by check."""
    for kind, mutate, phrase in (
            ("gemma-cells", lambda d: _swa(d).update(n_swa=0), "n_swa >= 1"),
            ("gemma-cells", lambda d: _swa(d).update(layers=[0, 1, 2, 3, 4, 99]), "inside 0..5"),
            ("gemma-cells", lambda d: _swa(d)["kq_mask_swa"]["rows"][0].append("-inf"), "rectangular slice"),
            ("gemma-cells", lambda d: _row(d)["visible_swa"].pop(), "visible_swa: has 7 items but T = 8"),
            ("gemma-cells", lambda d: d["config"].update(swa_layers=[True]), "config.swa_layers: has 1 entries but n_layer = 6"),
            ("spec-cells", _same_cell, "distinct cells"),
            ("hybrid", lambda d: _layer_types(d, d["config"]["layer_types"] * 2), "config.layer_types: has 8 entries"),
            ("hybrid", lambda d: _layer_types(d, ["full_attention", "linear_attention"] * 2), "must be config.layer_types")):
        t = traces(kind)
        d = _load(t)
        mutate(d)
        res = invoke("show", _tampered(t, d, tmp_path))
        assert res.exit_code == 2 and phrase in res.output, (phrase, res.output)


def test_truncated_tensor_file_is_unreadable(traces, tmp_path):
    t = _tampered(traces("plain"), _load(traces("plain")), tmp_path)
    f = t / "tensors.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    res = invoke("check", t)
    assert res.exit_code == 2 and "truncated" in res.output, res.output


def test_tensor_index_naming_a_missing_step(traces, tmp_path):
    """A tensor of a step the trace does not have (index and file both say so) is a violation."""
    from safetensors.numpy import load_file, save_file

    t = _tampered(traces("plain"), _load(traces("plain")), tmp_path)
    arrs = load_file(str(t / "tensors.safetensors"))
    arrs["step9/hidden"] = arrs["step0/hidden"]
    save_file(arrs, str(t / "tensors.safetensors"), metadata={"format": "pt"})
    d = _load(t)
    d["store"]["tensors"]["step9/hidden"] = d["store"]["tensors"]["step0/hidden"]
    (t / "trace.json").write_text(json.dumps(d), encoding="utf-8")
    res = invoke("check", t)
    assert res.exit_code == 1 and "step9/hidden names step 9, which the trace does not have" in res.output, res.output


def test_check_json_says_what_it_read(traces):
    out = json.loads(invoke("check", traces("summary"), "--json").output)
    assert out["ok"] is True and out["read"] == "trace.json (saved with --keep summary: no tensors)"


#: 301 tokens with the tiny byte tokenizer: past the 256-cell SWA pool (GGML_PAD(min(1024, 4 + 64), 256)),
#: so the SWA pool wraps (cells 0..44 take pos 256..300) while the base pool holds pos p in cell p
ISWA_LONG = "The quick brown fox jumps over the lazy dog. " * 7


@pytest.fixture(scope="module")
def iswa_traces(models, tmp_path_factory, llama_cpp) -> dict[str, Path]:
    root, out = tmp_path_factory.mktemp("iswa"), {}
    for eng in ("cells", "llama.cpp"):
        d = root / eng.replace(".", "")
        res = invoke("run", "-m", models["gemma3"], "--ignore-eos", "-p", ISWA_LONG, "--ctx-size", "1024",
                     "--max-batch-tokens", "64", "-n", "3", "--runtime", "llama.cpp" if eng == "llama.cpp" else "infertrace",
                     "--save", d)
        assert res.exit_code == 0, res.output[-800:]
        out[eng] = d
    return out


def _wrapped_swa_step(d: dict) -> tuple[dict, dict]:
    """The first step whose kq_mask_swa slice shows a reused SWA cell (cell index != its position)."""
    for st in d["steps"]:
        kq = (st["mask"].get("swa") or {}).get("kq_mask_swa")
        if kq and any(p >= 0 and p != kq["col_start"] + c for c, p in enumerate(kq["cell_pos"])):
            return st, kq
    raise AssertionError("no step shows a wrapped SWA cell")


@pytest.mark.parametrize("eng", ["cells", "llama.cpp"])
def test_iswa_separate_swa_pool_passes_check(iswa_traces, eng):
    """llama.cpp's iSWA cache (and the cells backend's mirror, kv/iswa.py) keeps the windowed layers in a
    256-cell SWA pool: after the wrap its kq_mask_swa is narrower than kq_mask (ne[0] 256 vs 512) and its
    cells hold other positions than the base pool's; ``check`` reads them from kv.physical.swa_pool
    (before, it demanded one pool's shape and exited 1 on a valid trace)."""
    t = iswa_traces[eng]
    d = _load(t)
    st, kq = _wrapped_swa_step(d)
    assert kq["ne"][0] == st["mask"]["swa"]["pool"]["n_kv"] == 256 and st["mask"]["kq_mask"]["ne"][0] == 512
    held = {c["cell"]: c["pos"] for c in st["kv"]["physical"]["swa_pool"]["cells"]}
    assert all(held[kq["col_start"] + c] == p for c, p in enumerate(kq["cell_pos"]) if p >= 0)
    assert any(kq["col_start"] + c < 45 and p >= 256 for c, p in enumerate(kq["cell_pos"]))  # a reused cell shown
    res = invoke("check", t)
    assert res.exit_code == 0 and "no violation" in res.output, res.output


@pytest.mark.parametrize("eng", ["cells", "llama.cpp"])
def test_iswa_swa_pool_cell_position_mutant_is_caught(iswa_traces, tmp_path, eng):
    t = iswa_traces[eng]
    d = _load(t)
    st, kq = _wrapped_swa_step(d)
    c = next(c for c, p in enumerate(kq["cell_pos"]) if p >= 256)
    cell = kq["col_start"] + c
    rec = next(x for x in st["kv"]["physical"]["swa_pool"]["cells"] if x["cell"] == cell)
    rec["pos"] = cell  # the base pool's numbering: what the one-pool reading would assume
    res = invoke("check", _tampered(t, d, tmp_path))
    out = res.output.strip()
    assert res.exit_code == 1, out
    assert f"kq_mask_swa says SWA cell {cell} holds pos {kq['cell_pos'][c]}, kv.physical.swa_pool says {cell}" in out, out


@pytest.mark.parametrize("kind", ["spec-cells", "spec-paged"])
def test_verify_step_decode_row_is_the_row_that_chose_the_token(traces, kind):
    """In a verify step every node has logits; ``decode.per_request[].row`` (and ``batch[].logits_row``)
    names the accepted path's node whose logits drew the emitted token: greedy, so the saved top-k
    tensor's first id on that row is the chosen token, and the recorded top-k is that row's. The
    draft model (1 of 3 layers) is rejected often, so the last node's row differs (before the fix
    the row named the chunk's last node while the top-k shown was the accepted node's)."""
    from safetensors.numpy import load_file

    t = traces(kind)
    d, tens = _load(t), load_file(str(t / "tensors.safetensors"))
    seen_rejection = 0
    for st in d["steps"]:
        for r in st["batch"]:
            if not r.get("spec"):
                continue
            p = next(p for p in st["decode"]["per_request"] if p["seq_id"] == r["seq_id"])
            acc, em = r["spec"]["accepted_nodes"], r["spec"]["emitted"]
            node = acc[min(len(em), len(acc)) - 1]
            rows = st["decode"]["logits_rows"]
            assert p["row"] == r["logits_row"] == rows.index(r["rows"][node])
            ids = tens[f"step{st['step']}/logits_topk_ids"][p["row"]]
            vals = tens[f"step{st['step']}/logits_topk_values"][p["row"]]
            assert int(ids[0]) == p["chosen"] == em[-1]
            assert [c["id"] for c in p["top"]][:3] == [int(x) for x in ids[:3]]
            assert abs(p["top"][0]["logit"] - float(vals[0])) < 1e-4
            seen_rejection += rows.index(r["rows"][-1]) != p["row"]
    assert seen_rejection > 0  # the rows told apart at least once


def test_prefix_cache_ignored_on_a_hybrid_model_is_recorded_off(models, tmp_path):
    """A hybrid model keeps no per-block GDN state, so ``--prefix-cache on`` is ignored with a note; the
    trace records what ran (prefix cache off: the option absent, as for any run without it), not the flag."""
    d = tmp_path / "t"
    res = invoke("run", "-m", models["qwen35"], "--ignore-eos", "-p", "hello", "-p", "hello", "--arrival", "0",
                 "--arrival", "2", "-n", "3", "--backend", "paged", "--prefix-cache", "on", "--save", d)
    assert res.exit_code == 0, res.output[-800:]
    m = _load(d)
    assert "prefix_cache" not in m["options"]["settings"], m["options"]["settings"]
    assert any(n.startswith("--prefix-cache on ignored") for n in m["notes"]), m["notes"]
    assert not any(r.get("prefix") for st in m["steps"] for r in st["batch"])
    assert invoke("check", d).exit_code == 0
