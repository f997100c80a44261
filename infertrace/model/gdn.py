"""Gated DeltaNet (GDN) math of Qwen3.5's ``linear_attention`` layers, for one sequence at a time.

Mirrors HF ``transformers/models/qwen3_5/modeling_qwen3_5.py`` (``Qwen3_5GatedDeltaNet``,
``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_*``,
``Qwen3_5RMSNormGated``) and llama.cpp ``src/models/qwen35.cpp`` ``build_layer_attn_linear``
(``ggml_ssm_conv`` -> silu -> ``ggml_l2_norm`` -> ``build_recurrent_attn`` -> ``build_norm_gated``).

The recurrence per value head (state ``S`` ``[d_k, d_v]``, ``q`` scaled by ``d_k**-0.5``)::

    S_t = exp(g_t) * S_{t-1}
    u_t = beta_t * (v_t - S_t^T k_t)          # the delta rule: write only what S does not predict
    S_t = S_t + k_t u_t^T
    o_t = S_t^T q_t

Prefill uses the chunked (UT-transform) form of the same recurrence, decode the one-token
update; both are exact reformulations and agree to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: chunk length of the chunked delta rule (HF / FLA ``chunk_size``).
CHUNK = 64
#: epsilon of the q/k L2 normalisation (HF ``l2norm``, FLA).
L2_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (float32 in, float32 out)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over the tokens of one sequence, continuing from ``conv_state``.

    Args:
        x: ``[T, C]`` current inputs (C = conv_dim channels).
        conv_state: ``[C, K-1]`` the previous K-1 inputs (zeros for a new sequence).
        w: ``[C, K]`` depthwise kernel.

    Returns:
        ``(y [T, C]`` after SiLU, ``new_state [C, K-1])`` (the last K-1 inputs).

    Mirrors HF ``causal_conv1d_fn`` / ``causal_conv1d_update`` and llama.cpp ``ggml_ssm_conv``.
    """
    T, C = x.shape
    K = w.shape[1]
    xin = torch.cat([conv_state.to(w.dtype), x.t().to(w.dtype)], dim=1)  # [C, K-1+T]
    new_state = xin[:, -(K - 1):] if K > 1 else xin[:, :0]  # [C, K-1]
    y = F.conv1d(xin.unsqueeze(0), w.unsqueeze(1), groups=C)[0]  # [C, T]
    return F.silu(y).t().to(x.dtype), new_state.to(conv_state.dtype)  # [T, C], [C, K-1]


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (decode).

    Args:
        q, k: ``[T, Hv, dk]`` float32 (L2-normed; q already scaled by ``dk**-0.5``).
        v: ``[T, Hv, dv]`` float32. g: ``[T, Hv]`` log decay (<= 0). beta: ``[T, Hv]`` in (0, 1).
        S: ``[Hv, dk, dv]`` float32 state before the tokens.

    Returns:
        ``(o [T, Hv, dv], S [Hv, dk, dv])``. Mirrors HF ``torch_recurrent_gated_delta_rule``.
    """
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]  # [Hv, dk, dv] decay
        pred = torch.einsum("hkv,hk->hv", S, k[t])  # [Hv, dv] what S predicts for k_t
        u = (v[t] - pred) * beta[t][:, None]  # [Hv, dv]
        S = S + k[t][:, :, None] * u[:, None, :]  # [Hv, dk, dv]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))  # [Hv, dv]
    return torch.stack(outs), S  # [T, Hv, dv], [Hv, dk, dv]


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       S: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (prefill): same arguments and results as :func:`delta_rule_recurrent`.

    Within a chunk of L tokens with cumulative log decay ``G_i = g_1 + .. + g_i``, the delta
    values solve a unit lower-triangular system (the UT transform)::

        (I + tril_{-1}(beta_i e^{G_i - G_j} k_i.k_j)) U = beta * (V - e^{G} K S0)
        O_i = e^{G_i} q_i^T S0 + sum_{j<=i} e^{G_i - G_j} (q_i.k_j) u_j
        S_L = e^{G_L} S0 + sum_j e^{G_L - G_j} k_j u_j^T

    Mirrors HF ``torch_chunk_gated_delta_rule`` / FLA ``chunk_gated_delta_rule`` (chunk 64).
    """
    T = q.shape[0]
    outs = []
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        qc, kc, vc = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # [Hv, L, d]
        gc, bc = g[s:e].t(), beta[s:e].t()  # [Hv, L]
        L = e - s
        G = gc.cumsum(-1)  # [Hv, L]
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # j <= i
        diff = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [Hv, L, L] e^{G_i-G_j}, 0 above
        kk = kc @ kc.transpose(-1, -2)  # [Hv, L, L]
        A = torch.eye(L, dtype=q.dtype, device=q.device) + (bc[:, :, None] * kk * diff).tril(-1)  # [Hv, L, L]
        rhs = bc[:, :, None] * (vc - G.exp()[:, :, None] * (kc @ S))  # [Hv, L, dv]
        U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [Hv, L, dv]
        o = G.exp()[:, :, None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * diff) @ U  # [Hv, L, dv]
        tail = (G[:, -1:] - G).exp()  # [Hv, L] e^{G_L - G_j}
        S = G[:, -1].exp()[:, None, None] * S + (kc * tail[:, :, None]).transpose(-1, -2) @ U  # [Hv, dk, dv]
        outs.append(o.transpose(0, 1))  # [L, Hv, dv]
    return torch.cat(outs), S


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(o) * w * silu(z)`` per head (HF ``Qwen3_5RMSNormGated``, llama.cpp ``build_norm_gated``).

    ``o``, ``z``: ``[N, Hv, dv]`` (model dtype); ``w``: ``[dv]``. Returns ``[N, Hv, dv]`` in ``o``'s dtype.
    """
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)  # [N, Hv, dv]
    y = w * y.to(o.dtype)  # [N, Hv, dv]
    return (y * F.silu(z.float())).to(o.dtype)


def gdn_sequence(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_w: torch.Tensor,
                 conv_state: torch.Tensor, S: torch.Tensor, n_k: int, n_v: int, dk: int, dv: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One sequence's tokens through conv + delta rule, continuing from its state.

    Args:
        qkv: ``[T, conv_dim]`` output of ``in_proj_qkv`` (model dtype).
        g, beta: ``[T, Hv]`` float32 log decay and write strength.
        conv_w: ``[conv_dim, K]``. conv_state: ``[conv_dim, K-1]``. S: ``[Hv, dk, dv]`` state.
        n_k, n_v, dk, dv: key heads, value heads, key / value head dims.

    Returns:
        ``(o [T, Hv, dv]`` in qkv's dtype, new conv_state, new S in S's dtype, taps ``{q, k, v}``).
        T == 1 uses the recurrent update, T > 1 the chunked form (HF chooses the same way).
    """
    T = qkv.shape[0]
    x, new_conv = causal_conv(qkv, conv_state, conv_w)  # [T, conv_dim], [conv_dim, K-1]
    q, k, v = torch.split(x, [n_k * dk, n_k * dk, n_v * dv], dim=-1)
    q = l2norm(q.reshape(T, n_k, dk).float())  # [T, Hk, dk]
    k = l2norm(k.reshape(T, n_k, dk).float())  # [T, Hk, dk]
    v = v.reshape(T, n_v, dv).float()  # [T, Hv, dv]
    if n_v != n_k:
        q = q.repeat_interleave(n_v // n_k, dim=1)  # [T, Hv, dk] grouped: v head h reads k head h // r
        k = k.repeat_interleave(n_v // n_k, dim=1)  # [T, Hv, dk]
    q = q * dk ** -0.5
    fn = delta_rule_recurrent if T == 1 else delta_rule_chunked
    o, S_new = fn(q, k, v, g, beta, S.float())  # [T, Hv, dv], [Hv, dk, dv]
    return o.to(qkv.dtype), new_conv, S_new.to(S.dtype), {"q": q, "k": k, "v": v}


def gdn_tree(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
             S: torch.Tensor, parents: list[int], n_k: int, n_v: int, dk: int, dv: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A speculative verify chunk through conv + delta rule, keeping the state after every candidate.

    Candidate i continues from its parent's state (``parents[i]``; -1 = the state before the chunk),
    one decode step each (:func:`gdn_sequence` with ``T == 1``, the same update a plain decode runs),
    so a tree branch never sees a sibling's tokens and a chain is the special case
    ``parents = [-1, 0, 1, ..]``. The states before the chunk are not changed: the accepted
    candidate's state is selected afterwards (:meth:`~infertrace.kv.recurrent.RecurrentState.select`).

    Args:
        qkv: ``[T, conv_dim]`` output of ``in_proj_qkv`` of the candidates (model dtype).
        g, beta: ``[T, Hv]`` float32. conv_w: ``[conv_dim, K]``.
        conv_state: ``[conv_dim, K-1]`` and S: ``[Hv, dk, dv]``: the request's state before the chunk.
        parents: chunk-local parent per candidate (``parents[0] == -1``; each parent an earlier node).
        n_k, n_v, dk, dv: key heads, value heads, key / value head dims.

    Returns:
        ``(o [T, Hv, dv]`` in qkv's dtype, conv states ``[T, conv_dim, K-1]`` in conv_state's dtype,
        recurrent states ``[T, Hv, dk, dv]`` in S's dtype): entry i is the state after candidate i.

    Raises:
        ValueError: ``parents`` is not a tree over the T candidates (a parent not before its node).

    Mirrors TensorRT-LLM ``_torch/modules/mamba/gdn_mixer.py`` ``forward_decode`` with
    ``is_target_verify``: ``causal_conv1d_update`` writes ``intermediate_conv_window`` and
    ``fused_recurrent_gated_delta_rule_update`` (``disable_state_update=True``) writes
    ``intermediate_states_buffer`` per draft token, the final state chosen later in
    ``MambaCacheManager.update_mamba_states`` (``accepted_leaf_positions`` for a tree).
    """
    T = qkv.shape[0]
    if len(parents) != T or any(not -1 <= p < i for i, p in enumerate(parents)) or (T and parents[0] != -1):
        raise ValueError(f"parents must be -1 then earlier nodes, one per candidate (got {parents[:8]} for {T} candidates)")
    o = torch.empty(T, n_v, dv, dtype=qkv.dtype, device=qkv.device)  # [T, Hv, dv]
    convs = torch.empty(T, *conv_state.shape, dtype=conv_state.dtype, device=conv_state.device)  # [T, conv_dim, K-1]
    Ss = torch.empty(T, *S.shape, dtype=S.dtype, device=S.device)  # [T, Hv, dk, dv]
    for i, p in enumerate(parents):
        c0, s0 = (conv_state, S) if p < 0 else (convs[p], Ss[p])  # the parent's state, not the previous row's
        o_i, conv_i, S_i, _ = gdn_sequence(qkv[i:i + 1], g[i:i + 1], beta[i:i + 1], conv_w, c0, s0,
                                           n_k, n_v, dk, dv)  # [1, Hv, dv]
        o[i] = o_i[0]
        convs[i] = conv_i
        Ss[i] = S_i
    return o, convs, Ss
