"""Terminal text built for a console that does not interpret markup (SafeConsole, markup=False):
no raw ``[green]``/``[bold]``/``[/...]`` tag may reach the user."""

from __future__ import annotations

import io
import re

from infertrace.present.render_llamacpp import render_llamacpp_diff
from infertrace.safe_text import SafeConsole

_TAG = re.compile(r"\[/?(bold|green|red|yellow|dim)\]|\[/")


def _rep(identical: bool) -> dict:
    nt = {"kl_mean": 1e-6, "kl_p99": 2e-6, "kl_max": 3e-6, "same_top": 4, "rows": 4, "same_top_rate": 1.0,
          "disagreements": [] if identical else [{"step": 1, "seq_id": 0, "pos": 3, "base_top": 5, "new_top": 6,
                                                    "rank_of_base_top_in_new": 2, "rank_of_new_top_in_base": 2,
                                                    "logp_gap_base": 0.5, "logp_gap_new": 0.4, "near_tie": False}]}
    fl = {"max_abs": {"hidden": 1e-3, "k": 1e-3, "v": 1e-3, "logits": 1e-2}, "factor": 4.0,
          "next_token": {"kl_mean": 1e-6, "kl_p99": 2e-6, "kl_max": 3e-6, "same_top": 4, "rows": 4}, "how": "f16 vs f32 [x]"}
    mism = [] if identical else [{"step": 1, "variable": "n_kv", "detail": "256 vs 512"}]
    return {"layer": 0, "structural": {"checked": 54, "mismatches": mism, "placement": "same cells",
                                       "mask_dtype": {"ours": ["F32"], "llama.cpp": ["F16"]}},
            "next_token": nt, "floor": fl, "max_abs": {"hidden": 1e-4, "k": 1e-4, "v": 1e-4, "logits": 1e-3},
            "first_exceeding": None if identical else {"step": 1, "layer": 0, "variable": "k", "value": 1.0, "tolerance": 0.1},
            "near_tie_rule": "gap < 0.1 nats", "identical": identical, "mismatches": mism}


def _render(rep: dict, color: bool) -> str:
    buf = io.StringIO()
    con = SafeConsole(file=buf, width=200, force_terminal=color, color_system="standard" if color else None)
    render_llamacpp_diff(con, rep)
    return buf.getvalue()


def test_llamacpp_diff_has_no_markup_tags() -> None:
    for identical in (True, False):
        out = _render(_rep(identical), color=False)
        assert not _TAG.search(out), out
        assert "cells backend vs llama.cpp (teacher-forced" in out
        if identical:
            assert "structure: 54 exact checks" in out and ": all equal" in out
            assert "first step over the floor: none" in out
            assert "identical in structure, within the noise floor" in out
        else:
            assert "1 differ" in out and "not a near tie" in out and "1 mismatch(es)" in out
        assert "f16 vs f32 [x]" in out  # a value with brackets is printed as is (no markup escape backslash)


def test_llamacpp_diff_styles_are_applied() -> None:
    out = _render(_rep(True), color=True)
    assert "\x1b[32m" in out and "\x1b[1m" in out  # green and bold as ANSI styles, not as tags
    assert not _TAG.search(out)
