"""The one memory protocol (kv/base.py ``Memory``, llama.cpp ``llama_memory_i``): every memory kind
answers the same operations as methods; one that cannot do an operation answers false and changes
nothing (llama.cpp's recurrent ``seq_rm`` of a part of a sequence; a paged middle range); callers
outside the memory never ask which kind they hold (checked in the source)."""

import ast
import re
from pathlib import Path

import pytest
import torch

from infertrace.errors import InfertraceError
from infertrace.kv.base import CellsInputs, ChunkSpec, PagedInputs
from infertrace.kv.cells import CellsKV
from infertrace.kv.paged import PagedKV
from infertrace.kv.recurrent import HybridKV, RecurrentState
from infertrace.kv.seq_ops import seq_rm
from infertrace.model.decoder import DecoderModel
from infertrace.model.rope import layer_ropes
from infertrace.loading.weights import load_checkpoint
from tests.unit.test_layering import imports_of
from tests.helpers.tiny import make_weights, write_gguf

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "infertrace"


def _hybrid(convention: str = "cells") -> HybridKV:
    """Model layers 0 (GDN) and 1, 2 (attention): 5 tokens of seq 0 with random K/V and state."""
    g = torch.Generator().manual_seed(0)
    attn = CellsKV(2, 1, 4, 16, 4) if convention == "cells" else PagedKV(2, 1, 4, 8, 4)
    st = RecurrentState([0], conv_dim=3, kernel=2, n_v_heads=1, k_head_dim=2, v_head_dim=2, n_slots=2, convention=convention)
    kv = HybridKV(attn, st, [1, 2])
    inp = kv.prepare([ChunkSpec(0, 0, 5)])
    for il in (1, 2):
        kv.write(il, torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g), inp)
    st.rec[0][st.slot_of(0)] = torch.randn(1, 2, 2, generator=g)
    return kv


@pytest.mark.parametrize("convention", ["cells", "paged"])
def test_recurrent_memory_refuses_a_partial_seq_rm_and_changes_nothing(convention):
    """llama.cpp ``llama_memory_hybrid::seq_rm``: the recurrent part answers false for a range cutting
    into the sequence, so nothing changes; the whole sequence goes in one call."""
    kv = _hybrid(convention)
    k1 = kv.read(1, 0)[0].clone()
    rec = kv.state.state_of(0, 0)[1].clone()
    op = kv.seq_rm(0, 3, -1)
    assert not op and "recurrent" in op["refused"]
    assert kv.seq_len(0) == 5 and torch.equal(kv.read(1, 0)[0], k1) and torch.equal(kv.state.state_of(0, 0)[1], rec)
    for refused in (kv.shift_out(0, 1, 3, layer_ropes_like(3)), kv.rewind(0, 3, 2, [0], None, 0, True),
                    kv.seq_cp(0, 1, 0, 3)):
        assert not refused and refused["refused"]
    assert kv.seq_len(0) == 5 and kv.state.slot_of(1) is None
    with pytest.raises(InfertraceError, match="recurrent"):
        seq_rm(kv, 0, 3, -1)  # the raising entry point
    assert kv.seq_rm(0, 7, -1)  # past the end: nothing to drop, allowed
    assert kv.seq_rm(0) and kv.seq_len(0) == 0 and kv.state.slot_of(0) is None
    assert kv.lookup(0, [1, 2, 3])["hit"] == 0  # no prefix reuse on a hybrid memory


def layer_ropes_like(n: int) -> list:
    return [None] * n  # never read: the hybrid refuses before any rotation


def test_paged_seq_rm_of_a_middle_range_is_refused_and_a_tail_is_freed():
    kv = PagedKV(1, 1, 4, 8, 4)
    kv.prepare([ChunkSpec(0, 0, 10)])  # 3 blocks
    tab = list(kv.tables[0])
    op = kv.seq_rm(0, 2, 4)
    assert not op and "only a tail" in op["refused"] and kv.tables[0] == tab and kv.seq_len(0) == 10
    op = kv.seq_rm(0, 6, -1)
    assert op and op["pos"] == "6..9" and op["freed_blocks"] == tab[2:] and kv.seq_len(0) == 6
    assert (kv.seq_pos_min(0), kv.seq_pos_max(0), kv.seq_pos_max(1)) == (0, 5, -1)


def test_cells_seq_pos_min_max_follow_the_cells():
    kv = CellsKV(1, 1, 4, 16, 2)
    kv.prepare([ChunkSpec(0, 0, 10)])
    assert kv.seq_rm(0, 0, 3)  # llama_memory_seq_pos_min/max: 3..9 left
    assert (kv.seq_pos_min(0), kv.seq_pos_max(0)) == (3, 9)
    assert (kv.seq_pos_min(1), kv.seq_pos_max(1)) == (-1, -1)


def test_cells_seq_div_rerotates_k_to_the_divided_positions(tmp_path):
    """llama.cpp ``seq_div`` (self-extend): positions 4..7 divided by 2 -> 2, 2, 3, 3; layer-0 K of those
    cells equals the decoder's layer-0 K of the same tokens computed at the new positions."""
    from infertrace.kv.audit import layer0_k

    w, s = make_weights(seed=4)
    ck = load_checkpoint(write_gguf(tmp_path / "m.gguf", w, s))
    m = DecoderModel(ck.config, ck.weights)
    ids = [72, 101, 108, 108, 111, 33, 34, 35]
    kv = CellsKV(m.cfg.n_layer, m.cfg.n_head_kv, m.cfg.head_dim, 32, 2)
    inp = kv.prepare([ChunkSpec(0, 0, 8)])
    m.forward(torch.tensor(ids), inp, kv, torch.tensor([7]))
    op = kv.seq_div(0, 4, -1, 2, layer_ropes(m.cfg))
    assert op and op["from"] == "4..7" and kv.pos[:8].tolist() == [0, 1, 2, 3, 2, 2, 3, 3]
    ref = layer0_k(m, ids[4:], [2, 2, 3, 3])  # [4, nkv, hd]
    assert (kv.k[0][4:8] - ref).abs().max() <= 1e-5
    assert not PagedKV(1, 1, 4, 4, 4).seq_div(0, 0, -1, 2, [None])  # "not supported" answer


def test_prepare_returns_the_conventions_typed_inputs():
    c = CellsKV(2, 1, 4, 16, 2, windows=[4, 0]).prepare([ChunkSpec(0, 0, 3)])
    assert isinstance(c, CellsInputs) and c.cell_idx.tolist() == [0, 1, 2] and c.kq_mask.shape[-1] == c.n_kv
    assert c.kq_mask_swa is not None and c.swa_layers == [0]
    p = PagedKV(1, 1, 4, 4, 4).prepare([ChunkSpec(0, 0, 5)])
    assert isinstance(p, PagedInputs) and p.slot_mapping.tolist() == [0, 1, 2, 3, 4] and p.kv_lens.tolist() == [5]
    assert _hybrid().prepare([ChunkSpec(1, 0, 2)]).state_indices == [1]


# ----------------------------------------------------------------------------- the source: nobody asks the kind

MEMORY_KEYS = ("cell_idx", "n_kv", "kq_mask", "kq_mask_swa", "n_tokens_pad", "head_before", "head_after", "cell_pos",
               "cell_seq", "slot_mapping", "block_tables", "seq_lens", "kv_lens", "cu_seqlens", "state_indices",
               "spec_decoding_packed_mask", "spec_decoding_position_offsets", "spec_tree_mask", "spec_q_pos")
#: the views of the memory and of its inputs: the one place that reads each layout's state, by ``layout`` /
#: the inputs' convention (llama.cpp's llama_memory_context_i side), so they are not callers of the protocol
VIEWS = (PKG / "capture" / "kv_views.py", PKG / "capture" / "mask_views.py")
CALLERS = [p for d in ("engine", "capture", "cli", "model") for p in sorted((PKG / d).rglob("*.py")) if p not in VIEWS] + \
    [PKG / "runner.py"]


def test_callers_never_switch_on_the_memory_kind_nor_probe_it():
    bad = []
    probe = re.compile(r"\b(hasattr|getattr)\(\s*(self\.)?(eng\.|engine\.|ctx\.)?kv\b")
    kind = re.compile(r"\bkv\.kind\s*(==|!=|in\b)")
    extra = re.compile(r"extra(\[|\.get\()\"(" + "|".join(MEMORY_KEYS) + r")\"")
    for p in CALLERS:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if probe.search(line) or kind.search(line) or extra.search(line):
                bad.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_memory_does_not_import_engine_runner_or_capture():
    bad = [f"{p.relative_to(ROOT)}:{n} imports {m}" for p in sorted((PKG / "kv").glob("*.py"))
           for n, m in imports_of(p, ROOT)
           if m.startswith(("infertrace.engine", "infertrace.runner", "infertrace.capture"))]
    assert not bad, "\n".join(bad)


def test_hybrid_memory_forwards_nothing_implicitly():
    """Composition, not attribute forwarding: HybridKV defines no __getattr__ / __setattr__."""
    tree = ast.parse((PKG / "kv" / "recurrent.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HybridKV")
    assert not {f.name for f in cls.body if isinstance(f, ast.FunctionDef)} & {"__getattr__", "__setattr__"}
