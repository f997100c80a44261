"""Agreement metrics of two next-token distributions, as the field measures engines that compute
differently (quantised activations, f16 caches):

* KL divergence ``KL(P_base || P_new) = sum_v P_base(v) (log P_base(v) - log P_new(v))`` per row,
  summarised by mean / 99th percentile / max as ``llama-perplexity --kl-divergence`` prints them
  (``tools/perplexity/perplexity.cpp``: "Mean KLD", "99.0% KLD", "Maximum KLD");
* same-top-token rate ("Same top p" in the same tool);
* for every row whose top tokens differ, the rank of each side's choice in the other's
  distribution (vLLM ``tests/models/utils.py`` ``check_logprobs_close``: each choice must be in the
  other side's top-k logprobs).

A disagreement is a **near tie** when, in both distributions, the other side's choice is in the
top ``k`` (vLLM's rule, k = 5) *and* its log-probability is within ``gap`` nats of the top
choice's (default 0.5 nats: the two candidates' probabilities differ by less than a factor 1.65).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: vLLM check_logprobs_close's top-k and our log-probability gap for a near tie (nats)
NEAR_TIE_TOPK = 5
NEAR_TIE_GAP = 0.5


def row_kl(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(base) || softmax(new))`` per row. ``base``, ``new``: ``[R, V]`` logits; returns ``[R]`` float64 (nats)."""
    lb = torch.log_softmax(base.double(), -1)  # [R, V]
    ln = torch.log_softmax(new.double(), -1)  # [R, V]
    return (lb.exp() * (lb - ln)).sum(-1).clamp_min(0.0)  # [R]


def rank_of(logits: torch.Tensor, token: int) -> int:
    """0-based rank of ``token`` in ``logits`` ``[V]`` (number of entries strictly greater)."""
    return int((logits > logits[token]).sum())


def compare_rows(base: torch.Tensor, new: torch.Tensor, labels: list[dict[str, Any]] | None = None,
                 k: int = NEAR_TIE_TOPK, gap: float = NEAR_TIE_GAP) -> dict[str, Any]:
    """Agreement of two sets of next-token logits rows (same tokens fed to both: teacher-forced).

    Args:
        base: ``[R, V]`` logits of the reference side (ours, float32).
        new: ``[R, V]`` logits of the other side (llama.cpp).
        labels: per row, fields copied into each disagreement (e.g. step, seq_id, pos).
        k, gap: the near-tie rule (module docstring).

    Returns:
        ``{"rows", "kl_mean", "kl_p99", "kl_max", "same_top", "same_top_rate", "max_abs_logits",
        "disagreements": [{..labels, "base_top", "new_top", "rank_of_new_top_in_base",
        "rank_of_base_top_in_new", "logp_gap_base", "logp_gap_new", "near_tie"}], "all_near_ties"}``.
    """
    R = int(base.shape[0])
    if R == 0:
        return {"rows": 0, "kl_mean": 0.0, "kl_p99": 0.0, "kl_max": 0.0, "same_top": 0, "same_top_rate": 1.0,
                "max_abs_logits": 0.0, "disagreements": [], "all_near_ties": True}
    kl = row_kl(base, new).numpy()  # [R]
    tb, tn = base.argmax(-1), new.argmax(-1)  # [R] each
    lb, ln = torch.log_softmax(base.double(), -1), torch.log_softmax(new.double(), -1)  # [R, V]
    dis = []
    for r in (tb != tn).nonzero().flatten().tolist():
        a, b = int(tb[r]), int(tn[r])
        rb, rn = rank_of(base[r], b), rank_of(new[r], a)
        gb, gn = float(lb[r, a] - lb[r, b]), float(ln[r, b] - ln[r, a])
        d = dict(labels[r]) if labels else {"row": r}
        d.update({"base_top": a, "new_top": b, "rank_of_new_top_in_base": rb, "rank_of_base_top_in_new": rn,
                  "logp_gap_base": round(gb, 4), "logp_gap_new": round(gn, 4),
                  "near_tie": rb < k and rn < k and gb <= gap and gn <= gap})
        dis.append(d)
    same = int((tb == tn).sum())
    return {"rows": R, "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "same_top": same, "same_top_rate": same / R, "max_abs_logits": float((base - new).abs().max()),
            "disagreements": dis, "all_near_ties": all(d["near_tie"] for d in dis)}
