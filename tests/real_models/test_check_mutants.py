"""``infertrace check`` derives the newer trace sections from the facts they summarise (each rule's
expected value from the convention's own definition, never from infertrace's output), and fails when a
section disagrees: unmodified traces the tool writes (the goldens under fixtures/ and small runs made
here: the real SmolLM2-135M on cells, paged with a prefix hit, ``--kv-unified off``, quantised weights
with an f16 cache, vLLM itself; tiny Gemma 3 with its SWA pool, a Qwen3.5-style MTP head and a hybrid
model with a 17-token prompt) pass; each well-typed inconsistent mutation of one of them fails with a
message naming the rule. Mutations the schema can refuse on its own (a field of the wrong type) are
refused in one line, exit 2, by ``check`` and ``show`` alike; ``show`` also refuses a trace ``check``
finds inconsistent in a variable it would draw as fact.

The conventions the rules recompute (see the package infertrace/trace/check/):
vLLM ``slot_mapping = block_table[p // B] * B + p % B``, ``query_start_loc`` = cumulative T,
``seq_lens`` = C + T, ``logits_indices`` = the last 1 + drafts rows of each request; llama.cpp
``n_stream = kv_unified ? 1 : n_seq_max`` and ``seq_to_stream[s] = s``; llama.cpp's M-RoPE text layout
``inp_pos = p, p, p, 0`` (``llm_graph_input_pos::set_input``); MTP: row k embeds token k and its argmax is
draft k."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from tests.helpers.tiny import make_weights, write_gguf
from tests.helpers.mutation import assert_mutant_caught, invoke, load_manifest as _load, tampered as _tampered
from tests.helpers.tiny_qwen35 import make_weights as make_q35, write_hf_dir

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden"
#: 21 tokens with SmolLM2's tokenizer: a second identical request hits 20 of them (5 full blocks of 4)
PREFIX_PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."
#: vLLM's CPU attention takes blocks of a multiple of 32 tokens: a prompt twice as long hits one whole block
VLLM_PREFIX = PREFIX_PROMPT + " " + PREFIX_PROMPT
HYBRID_17 = "abcdefghijklmnopq"  # 17 tokens with the tiny byte tokenizer: one more than the 16 columns recorded

RUNS: dict[str, tuple[str, list[str]]] = {
    "smol-cells": ("smol", ["-p", "Hi there", "-p", "Yo", "-n", "3"]),
    "smol-prefix-paged": ("smol", ["-p", PREFIX_PROMPT, "-p", PREFIX_PROMPT, "--arrival", "0", "--arrival", "2", "-n", "2",
                                   "--prefix-cache", "on", "--backend", "paged", "--tokens-per-block", "4"]),
    "smol-prefix-cells": ("smol", ["-p", PREFIX_PROMPT, "-p", PREFIX_PROMPT, "--arrival", "0", "--arrival", "2", "-n", "2",
                                   "--prefix-cache", "on"]),
    "smol-streams": ("smol", ["-p", "Hi", "-p", "Yo", "-n", "3", "--kv-unified", "off"]),
    "smol-quant": ("smol", ["-p", "Hi", "-n", "2", "--weights", "quant", "--kv-dtype", "f16"]),
    "gemma-swa": ("gemma3", ["-p", "abcdefgh", "-p", "xyz", "-n", "3"]),
    "mtp": ("mtp", ["-p", "Hello world", "-n", "6", "--speculative", "mtp"]),
    "hybrid-17": ("qwen35", ["-p", HYBRID_17, "-n", "2", "--backend", "paged"]),
    "hybrid-10": ("qwen35", ["-p", "abcdefghij", "-n", "2", "--backend", "paged"]),
    "llamacpp": ("smol", ["-p", "Hi there", "-p", "Yo", "-n", "3", "--runtime", "llama.cpp"]),
    "llamacpp-streams": ("smol", ["-p", "Hi there", "-p", "Yo", "-n", "3", "--runtime", "llama.cpp", "--kv-unified", "off"]),
    "llamacpp-gemma": ("gemma3", ["-p", "abcdefgh", "-n", "3", "--runtime", "llama.cpp"]),
    "vllm": ("smol", ["-p", "The capital of France is", "-p", "def add(a, b):", "--arrival", "0", "--arrival", "1",
                      "--prefill-chunk", "3", "-n", "4", "--num-blocks", "64", "--runtime", "vllm"]),
    "vllm-prefix": ("smol", ["-p", VLLM_PREFIX, "-p", VLLM_PREFIX, "--arrival", "0", "--arrival", "3", "-n", "2",
                             "--num-blocks", "64", "--tokens-per-block", "32", "--prefix-cache", "on", "--runtime", "vllm"]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory, smol_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {"smol": smol_path}
    w, s = make_weights(family="gemma3", n_layer=6, seed=5)  # layers 0..4 windowed (W = 4), 5 global
    out["gemma3"] = write_gguf(root / "g.gguf", w, s, kv={"attention.sliding_window": 4, "final_logit_softcapping": 3.0})
    w, s = make_q35(seed=2)
    out["qwen35"] = write_hf_dir(root / "q35", w, s)
    w, s = make_q35(seed=11, mtp=True, interval=2)
    out["mtp"] = write_hf_dir(root / "mtp", w, s)
    return out


@pytest.fixture(scope="module")
def traces(models, tmp_path_factory) -> Callable[[str], Path]:
    root, made = tmp_path_factory.mktemp("traces"), {}

    def get(kind: str) -> Path:
        if kind.startswith("golden/"):
            return GOLDEN / kind.split("/", 1)[1]
        if kind not in made:
            model, args = RUNS[kind]
            if "vllm" in args:  # vLLM is required (make test installs it): missing is a failure naming it
                from infertrace.runtimes.vllm import import_vllm

                import_vllm()
            if "llama.cpp" in args:
                import llama_cpp  # noqa: F401 - required as well (pip install -e '.[dev,llamacpp]')
            res = invoke("run", "-m", models[model], "--ignore-eos", *args, "--save", root / kind)
            assert res.exit_code == 0, res.output[-800:]
            made[kind] = root / kind
        return made[kind]
    return get




ALL = [*RUNS, *(f"golden/{p.name}" for p in sorted(GOLDEN.iterdir()) if (p / "trace.json").exists())]


@pytest.mark.parametrize("kind", ALL)
def test_unmodified_trace_passes_check_and_shows(traces, kind):
    t = traces(kind)
    res = invoke("check", t)
    assert res.exit_code == 0 and "no violation" in res.output, res.output
    assert invoke("show", t, "--steps", "0").exit_code == 0


# ----------------------------------------------------------------------------- helpers for mutations
def _st(d: dict, step: int) -> dict:
    return next(s for s in d["steps"] if s["step"] == step)


def _row(d: dict, step: int, seq: int) -> dict:
    return next(r for r in _st(d, step)["batch"] if r["seq_id"] == seq)


def _first(d: dict, pred: Callable[[dict], bool]) -> dict:
    return next(s for s in d["steps"] if pred(s))


def _vllm_two_rows(d: dict) -> dict:
    """The first vLLM step with two requests (seq 0 decoding or prefilling beside seq 1's chunk)."""
    return _first(d, lambda s: len(s["batch"]) == 2 and "vllm" in s)


def _hit_step(d: dict) -> dict:
    return _first(d, lambda s: any((r.get("prefix") or {}).get("hit") for r in s["batch"]))


def _hit_row(d: dict) -> dict:
    return next(r for r in _hit_step(d)["batch"] if (r.get("prefix") or {}).get("hit"))


def _set_hit(d: dict, hit: int, both: bool = True) -> None:
    st = _hit_step(d)
    r = _hit_row(d)
    if both:
        r["prefix"]["hit"] = hit
    st["serving"]["prefix"][str(r["seq_id"])]["hit"] = hit


def _move_cell_to_other_stream(d: dict) -> None:
    """Step 1 of the streams trace: seq 1's new cell 1025 (stream 1) renumbered into stream 0 (cell 5),
    the written range and the stream counts following it, so only the stream membership is wrong."""
    st = _st(d, 1)
    c = next(c for c in st["kv"]["physical"]["cells"] if c["cell"] == 1025)
    c["cell"] = 5
    next(p for p in st["kv"]["per_request"] if p["seq_id"] == 1)["cells"] = "5"


def _llamacpp_cell_in_stream0(d: dict) -> None:
    """Step 0 of llama.cpp's non-unified trace: seq 1's cell 1025 (its stream 1) renumbered 900 (stream 0),
    as the write says too."""
    st = _st(d, 0)
    next(c for c in st["kv"]["physical"]["cells"] if c["cell"] == 1025)["cell"] = 900
    next(p for p in st["kv"]["per_request"] if p["seq_id"] == 1)["cells"] = "900,1024"


def _swa_pool(d: dict, step: int = 1) -> dict:
    return _st(d, step)["kv"]["physical"]["swa_pool"]


def _drop_swa_cell(d: dict) -> None:
    """The SWA pool of step 1 loses seq 0's newest cell (pos 8): the next query's window 5..8 lacks it."""
    sp = _swa_pool(d)
    sp["cells"] = [c for c in sp["cells"] if not (c["pos"] == 8 and c["seq_ids"] == [0])]
    sp["used"] -= 1


def _dup_swa_cell(d: dict) -> None:
    sp = _swa_pool(d)
    sp["cells"].append(dict(sp["cells"][0]))
    sp["used"] += 1


def _mtp_row(d: dict) -> dict:
    return next(r for st in d["steps"] for r in st["batch"] if (r.get("spec") or {}).get("mtp") and r["T"] == 4)


def _mtp_other_argmax(d: dict) -> None:
    """MTP row 1 drafts another token: its argmax and spec.mtp.drafts agree with each other, not with the
    token the verify row checks at node 2."""
    mt = _mtp_row(d)["spec"]["mtp"]
    new = (mt["rows"][1]["argmax"] + 1) % 259
    mt["rows"][1]["argmax"] = new
    mt["drafts"][1] = new


def _vllm_sampled(d: dict) -> None:
    st = _first(d, lambda s: "vllm" in s and any(p.get("chosen") is not None for p in s["decode"]["per_request"]))
    i = next(i for i, p in enumerate(st["decode"]["per_request"]) if p.get("chosen") is not None)
    st["vllm"]["sampled_token_ids"][i][0] = (st["vllm"]["sampled_token_ids"][i][0] + 1) % 49152


def _vllm_new_block_of_other(d: dict) -> None:
    st = _first(d, lambda s: len(s["batch"]) == 2 and s.get("vllm", {}).get("scheduler", {}).get("new_block_ids"))
    nb = st["vllm"]["scheduler"]["new_block_ids"]
    sid = next(iter(nb))
    other = next(r["seq_id"] for r in st["batch"] if str(r["seq_id"]) != sid)
    theirs = st["vllm"]["attn_metadata"]["block_table"][[r["seq_id"] for r in st["batch"]].index(other)]
    nb[sid] = [theirs[0]]


def _vllm_tp(d: dict) -> None:
    st = _vllm_two_rows(d)
    st["vllm"]["tp_ranks"] = [{"tp_rank": 0, "kv_heads_held": 3, "metadata_equals_rank0": True},
                              {"tp_rank": 1, "kv_heads_held": 3, "metadata_equals_rank0": True}]


def _vllm_free(d: dict) -> None:
    """free_blocks as if every block but the null block were free, in both records (used + free = num_blocks)."""
    st = _vllm_two_rows(d)
    ph = st["kv"]["physical"]
    ph.update(free_blocks=ph["num_blocks"] - 1, used_blocks=1)
    st["vllm"]["scheduler"]["free_blocks"] = ph["num_blocks"] - 1


def _computed_from(d: dict, start: int) -> None:
    st, r = _hit_step(d), _hit_row(d)
    end = r["C"] + r["T"] - 1
    for rec in (r["prefix"], st["serving"]["prefix"][str(r["seq_id"])]):
        rec["computed"] = f"{start}..{end}"


def _shared_blocks_other(d: dict) -> None:
    st, r = _hit_step(d), _hit_row(d)
    for rec in (r["prefix"], st["serving"]["prefix"][str(r["seq_id"])]):
        rec["shared_blocks"] = list(reversed(rec["shared_blocks"]))


def _physical_table_other(d: dict) -> None:
    """Step 1 of the paged prefix trace: kv.physical says seq 0's last block is an unused one (60),
    while the slots were written through the table kv.per_request records."""
    st = _st(d, 1)
    st["kv"]["physical"]["requests"]["0"]["block_table"][-1] = 60


# kind, mutation, exit codes allowed, a phrase the one line must carry (the rule's name or the schema's words)
MUTANTS: dict[str, tuple[str, Callable[[dict], None], tuple[int, ...], str]] = {
    # item 11: the per-step vllm section
    "vllm slot_mapping off by one": ("vllm", lambda d: _vllm_two_rows(d)["vllm"]["attn_metadata"]["slot_mapping"].__setitem__(
        0, _vllm_two_rows(d)["vllm"]["attn_metadata"]["slot_mapping"][0] + 1), (1,), "slot = table[p // B] * B + p % B"),
    "vllm query_start_loc not cumulative T": ("vllm", lambda d: _vllm_two_rows(d)["vllm"]["attn_metadata"][
        "query_start_loc"].__setitem__(1, _vllm_two_rows(d)["vllm"]["attn_metadata"]["query_start_loc"][1] + 1), (1,),
        "query_start_loc from the batch"),
    "vllm seq_lens not C + T": ("vllm", lambda d: _vllm_two_rows(d)["vllm"]["attn_metadata"]["seq_lens"].__setitem__(
        0, _vllm_two_rows(d)["vllm"]["attn_metadata"]["seq_lens"][0] + 1), (1,), "seq_lens from the batch"),
    "vllm sampled token not the chosen one": ("vllm", _vllm_sampled, (1,), "sampled tokens are the chosen ones"),
    "vllm logits index past N": ("vllm", lambda d: _vllm_two_rows(d)["vllm"]["logits_indices"].__setitem__(
        -1, _vllm_two_rows(d)["N"]), (1,), "logits_indices"),
    "vllm logits index of a middle row": ("vllm", lambda d: _vllm_two_rows(d)["vllm"]["logits_indices"].__setitem__(
        -1, _vllm_two_rows(d)["N"] - 2), (1,), "logits_indices"),
    "vllm num_scheduled_tokens": ("vllm", lambda d: _vllm_two_rows(d)["vllm"]["scheduler"]["scheduled"][0].update(
        num_scheduled_tokens=_vllm_two_rows(d)["batch"][0]["T"] + 1), (1,), "scheduler counts"),
    "vllm num_computed_tokens": ("vllm", lambda d: _vllm_two_rows(d)["vllm"]["scheduler"]["scheduled"][1].update(
        num_computed_tokens=_vllm_two_rows(d)["batch"][1]["C"] + 2), (1,), "scheduler counts"),
    # the scheduler's order is not the forward's (vLLM's runner reorders its batch): compared per sequence, so a
    # wrong count still fails when the scheduled list is in another order
    "vllm num_computed_tokens, scheduled in another order": ("vllm", lambda d: (
        _vllm_two_rows(d)["vllm"]["scheduler"]["scheduled"].reverse(),
        _vllm_two_rows(d)["vllm"]["scheduler"]["scheduled"][0].update(
            num_computed_tokens=_vllm_two_rows(d)["batch"][1]["C"] + 2)), (1,), "scheduler counts"),
    "vllm total_num_scheduled_tokens": ("vllm", lambda d: _vllm_two_rows(d)["vllm"]["scheduler"].update(
        total_num_scheduled_tokens=_vllm_two_rows(d)["N"] + 1), (1,), "scheduler counts"),
    "vllm free_blocks leaves no block for the tables": ("vllm", _vllm_free, (1,), "free blocks of the pool"),
    "vllm free_blocks differs from the pool's": ("vllm", lambda d: _vllm_two_rows(d)["vllm"]["scheduler"].update(
        free_blocks=_vllm_two_rows(d)["vllm"]["scheduler"]["free_blocks"] - 1), (1,), "free blocks of the pool"),
    "vllm new block of another sequence": ("vllm", _vllm_new_block_of_other, (1,), "new blocks owned by their sequence"),
    "vllm two ranks for tensor_parallel_size 1": ("vllm", _vllm_tp, (1,), "ranks = tensor_parallel_size"),
    "vllm section in a trace of our engine": ("vllm", lambda d: d.update(runtime="infertrace"), (1,),
                                              "the runtime named in the header"),
    "vllm step without its section": ("vllm", lambda d: _vllm_two_rows(d).pop("vllm"), (1,), "the runtime named in the header"),
    # item 11: stream membership under --kv-unified off
    "a cell in another sequence's stream": ("smol-streams", _move_cell_to_other_stream, (1,), "cells inside the sequence's stream"),
    "kv_unified recorded on with streams": ("smol-streams", lambda d: d["options"]["settings"].pop("kv_unified"), (1,),
                                            "streams as configured"),
    "llama.cpp cell in another sequence's stream": ("llamacpp-streams", _llamacpp_cell_in_stream0, (1,),
                                                    "cells inside the sequence's stream"),
    "stream used count": ("smol-streams", lambda d: _st(d, 2)["kv"]["physical"]["streams"][1].update(used=2), (1,),
                          "cells inside the sequence's stream"),
    "per_request stream of another sequence": ("smol-streams", lambda d: _st(d, 0)["kv"]["per_request"][1].update(stream=0),
                                               (1,), "cells inside the sequence's stream"),
    "kq_mask stream block of another sequence": ("smol-streams", lambda d: _st(d, 0)["mask"]["kq_mask"]["streams"][1].update(
        seq_ids=[0]), (1,), "kq_mask streams"),
    "kq_mask streams swapped": ("smol-streams", lambda d: _st(d, 0)["mask"]["kq_mask"]["streams"].reverse(), (1,),
                                "kq_mask stream"),  # the isolation rule meets it first: block 0's rows see stream 1's cells
    # item 11: the SWA pool's cells
    "SWA pool cell listed twice": ("gemma-swa", _dup_swa_cell, (1,), "SWA pool cells"),
    "SWA pool used": ("gemma-swa", lambda d: _swa_pool(d).update(used=_swa_pool(d)["used"] + 1), (1,), "SWA pool cells"),
    "SWA pool lacks a cell of the window": ("gemma-swa", _drop_swa_cell, (1,), "SWA pool cells"),
    # item 11: MTP rows against spec
    "MTP drafts not the rows' argmax": ("mtp", lambda d: _mtp_row(d)["spec"]["mtp"]["drafts"].__setitem__(0, 5), (1,),
                                        "MTP rows agree with the drafts"),
    "MTP argmax not the drafted token": ("mtp", _mtp_other_argmax, (1,), "MTP rows agree with the drafts"),
    "MTP row embeds another token": ("mtp", lambda d: _mtp_row(d)["spec"]["mtp"]["rows"][2].update(
        token=(_mtp_row(d)["spec"]["mtp"]["rows"][2]["token"] + 1) % 259), (1,), "MTP rows agree with the drafts"),
    "MTP rows with speculative draft": ("mtp", lambda d: d["options"]["settings"].update(speculative="draft"), (1,),
                                        "MTP rows agree with the drafts"),
    "MTP rows without an MTP layer": ("mtp", lambda d: d["config"].update(mtp_layers=0), (1,), "MTP rows agree with the drafts"),
    # item 11: kv.dtype and the quant kernels
    "kv.dtype not the --kv-dtype": ("smol-quant", lambda d: _st(d, 0)["kv"].update(dtype="float32"), (1,),
                                    "kv dtype as configured: kv.dtype is 'float32' but options give kv_dtype 'f16' = float16"),
    "kv.dtype not the compute dtype": ("smol-cells", lambda d: _st(d, 1)["kv"].update(dtype="bfloat16"), (1,),
                                       "kv dtype as configured"),
    "llama.cpp kv.dtype not its type_k": ("llamacpp", lambda d: _st(d, 0)["kv"].update(dtype="float32"), (1,),
                                          "kv dtype as configured: kv.dtype is 'float32' but options give kv_dtype 'f16'"),
    "int4 kernel with float32 activations": ("smol-quant", lambda d: d["options"]["weights"]["kernels"].update(Q4_1="int4pack"),
                                             (1,), "quant kernels the chooser returns"),
    "kernel of another type": ("smol-quant", lambda d: d["options"]["weights"]["kernels"].update(Q8_0="dense"), (1,),
                               "quant kernels the chooser returns"),
    "kernel for a type without one": ("smol-quant", lambda d: d["options"]["weights"]["kernels"].update(IQ2_XXS="dequant"),
                                      (1,), "quant kernels the chooser returns"),
    # item 11: paged per_request block tables against kv.physical
    "physical table differs from the written one": ("smol-prefix-paged", _physical_table_other, (1,), "block table recorded once"),
    "physical len": ("smol-prefix-paged", lambda d: _st(d, 1)["kv"]["physical"]["requests"]["0"].update(
        len=_st(d, 1)["kv"]["physical"]["requests"]["0"]["len"] - 1), (1,), "block table recorded once"),
    # item 12: prefix hits
    "prefix hit shorter in both copies": ("smol-prefix-paged", lambda d: _set_hit(d, 16), (1,),
                                          "chunk starts where the prefix hit ends"),
    "prefix hit shorter in serving.prefix only": ("smol-prefix-paged", lambda d: _set_hit(d, 16, both=False), (1,),
                                                  "prefix hit recorded once"),
    "prefix hit of the cells trace shorter": ("smol-prefix-cells", lambda d: _set_hit(d, 8), (1,),
                                              "chunk starts where the prefix hit ends"),
    "prefix computed range starts before the hit": ("smol-prefix-paged", lambda d: _computed_from(d, 8), (1,),
                                                    "chunk starts where the prefix hit ends"),
    "prefix shared blocks reordered": ("smol-prefix-paged", _shared_blocks_other, (1,), "shared blocks are the hit's full blocks"),
    "vllm prefix hit shorter": ("vllm-prefix", lambda d: _set_hit(d, 16), (1,), "chunk starts where the prefix hit ends"),
    "vllm prefix hit shorter in serving.prefix only": ("vllm-prefix", lambda d: _set_hit(d, 16, both=False), (1,),
                                                       "prefix hit recorded once"),
    # item 12: the hybrid positions, as recorded
    "hybrid position_ids column": ("hybrid-17", lambda d: _st(d, 0)["hybrid"]["positions"]["position_ids"][1].__setitem__(3, 9),
                                   (1,), "hybrid inp_pos = packed positions"),
    "hybrid inp_pos fourth section not 0": ("hybrid-10", lambda d: _st(d, 0)["hybrid"]["positions"]["inp_pos"].__setitem__(
        -1, 9), (1,), "hybrid inp_pos = packed positions"),
    "hybrid inp_pos_len": ("hybrid-17", lambda d: _st(d, 0)["hybrid"]["positions"].update(inp_pos_len=64), (1, 2), "inp_pos_len"),
    # item 13: the schema types every option and config field (show refuses them too)
    "num_spec_tokens a range text": ("mtp", lambda d: d["options"]["settings"].update(num_spec_tokens="0..99999999999"), (2,),
                                     "options.settings.num_spec_tokens: expected an integer"),
    "num_spec_tokens past the limit": ("mtp", lambda d: d["options"]["settings"].update(num_spec_tokens=65), (2,),
                                       "options.settings.num_spec_tokens: 65 is outside 1..64"),
    "prefix_cache a list": ("smol-prefix-paged", lambda d: d["options"]["settings"].update(prefix_cache=[1e9, 1e9, 1e9]), (2,),
                            "options.settings.prefix_cache: expected true or false"),
    "speculative not a method": ("mtp", lambda d: d["options"]["settings"].update(speculative="eagle9"), (2,),
                                 "options.settings.speculative"),
    "rope_theta_swa an object": ("gemma-swa", lambda d: d["config"].update(rope_theta_swa={}), (2,),
                                 "config.rope_theta_swa: expected a number"),
    "rope_theta_swa NaN": ("gemma-swa", lambda d: d["config"].update(rope_theta_swa=float("nan")), (2,), "config.rope_theta_swa"),
    "mtp_layers a string": ("mtp", lambda d: d["config"].update(mtp_layers="1"), (2,), "config.mtp_layers: expected an integer"),
    "qk_norm a number": ("gemma-swa", lambda d: d["config"].update(qk_norm=1), (2,), "config.qk_norm: expected true or false"),
    "audit seqs a list": ("smol-cells", lambda d: _st(d, 0).update(serving={"audit": {"seqs": [-8]}}), (2,),
                          "serving.audit.seqs: expected an object"),
    "audit seqs negative": ("smol-cells", lambda d: _st(d, 0).update(serving={"audit": {"seqs": {"0": -8}}}), (2,),
                            "serving.audit.seqs.0: -8 is outside"),
    "options.dtype not a dtype": ("smol-cells", lambda d: d["options"].update(dtype="float8"), (2,), "options.dtype"),
    "vllm block_size a string": ("vllm", lambda d: d["options"]["vllm"].update(block_size="16"), (2,),
                                 "options.vllm.block_size: expected an integer"),
}


@pytest.mark.parametrize("case", list(MUTANTS))
def test_mutant_is_caught(traces, tmp_path, case):
    kind, mutate, codes, phrase = MUTANTS[case]
    assert_mutant_caught(traces(kind), mutate, codes, phrase, tmp_path)


#: mutants check fails (exit 1) in a variable show draws as fact: show refuses them in one line, exit 2
SHOW_REFUSES = ["a cell in another sequence's stream", "vllm slot_mapping off by one", "SWA pool lacks a cell of the window", "physical table differs from the "
                "written one", "prefix hit shorter in both copies", "hybrid position_ids column"]


def _swa_keys_past_window(d: dict) -> None:
    """Seq 0's query at pos 7 sees keys 3..7 on the windowed layers (W = 4: 4..7), in the row and in mask.swa.visible."""
    _row(d, 0, 0)["visible_swa"][7] = "3..7"
    next(v for v in _st(d, 0)["mask"]["swa"]["visible"] if v["seq_id"] == 0)["queries"][7]["keys"] = "3..7"


def test_show_refuses_the_swa_keys_mutant(traces, tmp_path):
    t = traces("gemma-swa")
    d = _load(t)
    _swa_keys_past_window(d)
    bad = _tampered(t, d, tmp_path)
    chk = invoke("check", bad)
    assert chk.exit_code == 1 and "expected 4..7" in chk.output, chk.output
    res = invoke("show", bad)
    out = res.output.strip()
    assert res.exit_code == 2 and len(out.splitlines()) == 1, out
    assert "inconsistent trace, not shown" in out and "window: query pos 7 sees keys '3..7'" in out, out


@pytest.mark.parametrize("case", SHOW_REFUSES)
def test_show_refuses_what_check_refuses(traces, tmp_path, case):
    kind, mutate, _, phrase = MUTANTS[case]
    t = traces(kind)
    d = _load(t)
    mutate(d)
    res = invoke("show", _tampered(t, d, tmp_path))
    assert res.exit_code == 2 and "inconsistent trace, not shown" in res.output and phrase in res.output, res.output


def test_hybrid_17_token_prompt_records_positions_cut(traces):
    """The 17-token hybrid prefill: position_ids are listed for the first 16 columns and inp_pos not at all
    (the record's bound), and check compares them as recorded (before: exit 1, 'hybrid inp_pos')."""
    hp = _st(_load(traces("hybrid-17")), 0)["hybrid"]["positions"]
    assert hp["position_ids_shape"] == [3, 1, 17] and hp["position_ids"] == [list(range(16))] * 3
    assert hp["inp_pos"] == [] and hp["inp_pos_len"] == 17 * 4
    short = _st(_load(traces("hybrid-10")), 0)["hybrid"]["positions"]
    assert short["inp_pos"] == list(range(10)) * 3 + [0] * 10  # llama.cpp: p, p, p, then 0 for text


def test_prefix_hit_starts_the_first_chunk(traces):
    """The hits the mutants shorten are real ones and start the request's first chunk: our engine reuses every
    prompt token but the last (recomputed for its logits: hit = prompt_len - 1), sharing the full blocks it
    covers (hit // B of them, the partial one copied) on paged; vLLM hits whole blocks of 32 only."""
    for kind, B in (("smol-prefix-paged", 4), ("smol-prefix-cells", None), ("vllm-prefix", 32)):
        d = _load(traces(kind))
        r = _hit_row(d)
        h, n = r["prefix"]["hit"], len(d["requests"][r["seq_id"]]["prompt_ids"])
        assert r["C"] == h > 0, (kind, h, r["C"])
        if kind == "vllm-prefix":
            assert h % B == 0 and h == (n - 1) // B * B, (h, n)
        else:
            assert h == n - 1, (h, n)
        if B:
            assert len(r["prefix"]["shared_blocks"]) == h // B, r["prefix"]


def test_kernel_rule_check_reads_is_the_chooser_itself():
    """The kernels ``check`` allows per (type, dtype) are exactly what quant/source.py's chooser returns over
    packable and unpackable shapes, and its types the decoders there are (one rule, torch-free for check)."""
    import torch

    from infertrace.quant.blocks import DECODERS
    from infertrace.quant.choice import QUANT_TYPES, possible_kernels
    from infertrace.quant.source import choose_kernel

    assert set(QUANT_TYPES) == set(DECODERS)
    for t in (*QUANT_TYPES, "F32", "F16", "BF16"):
        for name in ("float32", "bfloat16", "float16"):
            dt = getattr(torch, name)
            want = {choose_kernel(t, dt, shape) for shape in ((640, 1024), (8, 1024), (16, 31), (1, 1))}
            assert possible_kernels(t, name) == want, (t, name)
    assert possible_kernels("Q4_K", "bfloat16") == {"int4pack", "dequant"} and possible_kernels("Q4_K", "float32") == {"dequant"}
    assert possible_kernels("IQ2_XXS", "float32") == set()
