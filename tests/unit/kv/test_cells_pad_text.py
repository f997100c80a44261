"""``n_kv`` padding as llama.cpp ``get_n_kv`` pads it (a multiple of 256): the ``dump-kv`` text names
the constant the cells backend uses, and the trace checks admit n_kv = 512 once a cell past 256 is used."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from tests.helpers import hostile as H
from infertrace.cli.app import app
from infertrace.kv.cells import N_PAD


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_dump_kv_text_names_the_padding_used() -> None:
    assert N_PAD == 256  # llama.cpp get_n_kv: max(n_pad, 256)
    res = _invoke("dump-kv", "--step", "1", H.GOLDEN / "worked-example-cells")
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.replace("│", " ").split())  # the panel wraps the line
    assert f"used_max_p1 padded to a multiple of {N_PAD}" in out, out
    assert "padded to 32" not in out


def test_n_kv_512_after_cell_256_is_a_valid_trace(tmp_path: Path) -> None:
    t = tmp_path / "t"
    shutil.copytree(H.GOLDEN / "worked-example-cells", t)
    d = json.loads((t / "trace.json").read_text())
    # step 1 writes pos 3 into cell 299 instead of cell 3 (find_slot may pick any free cell), and every record of that
    # cell says so in steps 1..2: the write, the cells, the seq's cells, the kq_mask columns. used_max_p1 = 300 →
    # llama.cpp n_kv = 512 (was refused: bound padded 300 to 32 → 320)
    d["steps"][1]["kv"]["per_request"][0]["cells"] = "299"
    for st in d["steps"][1:]:
        ph = st["kv"]["physical"]
        next(c for c in ph["cells"] if c["cell"] == 3)["cell"] = 299
        ph["n_kv"] = 512
        ph["seqs"]["0"]["cells"] = {"0..3": "0..2,299", "0..4": "0..2,4,299"}[ph["seqs"]["0"]["cells"]]
        m = st["mask"]["kq_mask"]
        m["n_kv"], m["ne"][0], m["torch_shape"][-1] = 512, 512, 512
        m["cell_pos"][3], m["cell_seq"][3] = -1, []  # cell 3 now empty (the columns shown are cells 0..15)
        for row in m["rows"]:
            row[3] = "-inf"
    (t / "trace.json").write_text(json.dumps(d))
    res = _invoke("show", t)
    assert "n_kv" not in (res.stderr or ""), res.stderr
    assert res.exit_code == 0, res.stderr
    ph = d["steps"][1]["kv"]["physical"]
    ph["n_kv"] = 768  # beyond the padding of 300: still refused
    (t / "trace.json").write_text(json.dumps(d))
    res = _invoke("show", t)
    assert res.exit_code == 2 and "(padded: 512)" in res.stderr, res.stderr
