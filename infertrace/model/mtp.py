"""Qwen3.5's multi-token-prediction (MTP / NextN) draft head: one extra full-attention block that
predicts the token after next from the main model's hidden state and the next token's embedding.

The wiring, as the three runtimes build it (they agree on every point below):

* vLLM ``vllm/model_executor/models/qwen3_5_mtp.py`` ``Qwen3_5MultiTokenPredictor.forward``
  (lines 146-191; ``qwen3_next_mtp.py`` lines 131-158 is the same for Qwen3-Next):
  ``e = pre_fc_norm_embedding(embed_tokens(input_ids))``, ``h = pre_fc_norm_hidden(hidden_states)``,
  ``x = fc(cat([e, h], -1))`` (embedding first), one ``Qwen3_5DecoderLayer(layer_type="full_attention")``,
  then the MTP's own ``norm`` (``mtp.norm``); ``Qwen3_5MTP.compute_logits`` (lines 295-300) applies the
  shared ``lm_head``; ``embed_tokens`` is the main model's (``load_weights`` lines 307-319).
* TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_qwen3_next.py`` (commit 00022b04) ``Qwen3NextMTP.forward``:
  ``concat([pre_fc_norm_embedding(embed_tokens(input_ids)), pre_fc_norm_hidden(hidden_states)])``,
  ``fc``, the full-attention decoder layer, ``shared_head.norm``; ``Qwen3NextMTPHead`` applies the lm head.
* llama.cpp ``src/models/qwen35.cpp`` ``llama_model_qwen35::graph_mtp`` (lines 485-644 of the source
  vendored by llama-cpp-python 0.3.36): ``hnorm(h)``, ``enorm(tok_embd[token])`` (lines 540-544),
  ``ggml_concat(e_norm, h_norm)`` then ``nextn.eh_proj`` (lines 546-550), a gated full-attention
  block (QK-norm, partial M-RoPE, ``* sigmoid(gate)``, lines 552-622), ``nextn.shared_head_norm``
  (falls back to ``output_norm``) and the output head (lines 624-643); tensors loaded by ``load_block_mtp``
  (lines 93-116) as ``blk.{n_layer}``; the result after the head
  norm is ``t_h_nextn``, the hidden state a chained draft feeds back.

Which hidden state: the main model's last hidden state *after its final norm* -- vLLM's
``Qwen3NextModel.forward`` returns ``self.norm(hidden_states, residual)`` (qwen3_next.py line 739),
TensorRT-LLM sets the last layer's ``next_layer_layernorm`` to ``model.norm``, llama.cpp exposes
``t_h_nextn`` after ``output_norm`` (qwen35.cpp lines 206-209). Row ``p`` of the MTP pairs the
target's hidden at position ``p`` with the token at ``p + 1`` and runs at position ``p``
(vLLM ``llm_base_proposer.py`` ``set_inputs_first_pass``: input ids shifted by one, positions
unchanged); its logits propose the token at ``p + 2``. A chained draft feeds the MTP's own
post-norm hidden state back with the drafted token at the next position. llama.cpp
(``common/speculative.cpp`` ``common_speculative_impl_draft_mtp::process`` / ``draft``) runs the same
row at the token's position ``p + 1`` instead; every row shifts by one, and RoPE attention depends
on position differences only, so the draft is the same (tests/unit/model/test_mtp.py checks it).

Norm weights are in the engine's stored convention (``1 + w``: llama.cpp's converter adds 1 to
every ``*norm.weight`` of Qwen3.5, the MTP's included; HF weights get +1 at load).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from infertrace.errors import InfertraceError
from infertrace.model.families import family_of
from infertrace.model.layers import Block, build_block, on_device

if TYPE_CHECKING:
    from infertrace.kv.base import AttnInputs, KVBackend

#: what the trace says of each hidden-state source of an MTP row
TARGET_HIDDEN = "target: last layer's output after output_norm (llama.cpp t_h_nextn, vLLM/TRT-LLM model output)"
MTP_HIDDEN = "mtp: the MTP block's output after nextn.shared_head_norm (mtp.norm), fed back for a chained draft"


class MTPHead:
    """The MTP block ``blk.{n_layer}`` of a model, sharing its embeddings, lm head and RoPE.

    Args:
        model: the main :class:`~infertrace.model.decoder.DecoderModel` (embeddings, head, norm flavour,
            RoPE tables and linear ops are its own).
        weights: engine-named tensors with ``blk.{n_layer}.*`` (a full-attention block under the family's
            slot names) and ``blk.{n_layer}.nextn.{eh_proj [H, 2H], enorm [H], hnorm [H], shared_head_norm [H]}``.

    Raises:
        InfertraceError: a tensor is missing.
    """

    def __init__(self, model: Any, weights: Mapping[str, Any]):
        cfg = model.cfg
        self.il = il = cfg.n_layer
        self.model = model
        dev = model.device
        for s in ("eh_proj", "enorm", "hnorm", "shared_head_norm"):
            if f"blk.{il}.nextn.{s}" not in weights:
                raise InfertraceError(f"the weights lack tensor blk.{il}.nextn.{s}, which the MTP head needs; the checkpoint "
                                      "is incomplete")
        # layer il is past layer_types, so build_block gives it the (gated) attention mixer, window 0
        self.block: Block = build_block(cfg, weights, il, family_of(cfg).block_names, model.ops, dev)
        self.eh_proj = on_device(weights[f"blk.{il}.nextn.eh_proj"], dev)  # [H, 2H] (HF mtp.fc)
        self.enorm = weights[f"blk.{il}.nextn.enorm"].to(dev)  # [H] (HF mtp.pre_fc_norm_embedding, 1 + w)
        self.hnorm = weights[f"blk.{il}.nextn.hnorm"].to(dev)  # [H] (HF mtp.pre_fc_norm_hidden, 1 + w)
        self.head_norm = weights[f"blk.{il}.nextn.shared_head_norm"].to(dev)  # [H] (HF mtp.norm, 1 + w)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, attn: AttnInputs, kv: KVBackend,
                logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step over a packed batch (rows of several requests, as the main forward).

        Args:
            input_ids: ``[N]`` int64, row p's token is the one at position ``p + 1`` of its request
                (the token after the hidden state's position).
            hidden: ``[N, H]`` the hidden state paired with each row (the target's after ``output_norm``,
                or the MTP's own after ``shared_head_norm`` for a chained draft).
            attn: the MTP memory's :class:`AttnInputs` (positions ``[N]``: the hidden state's positions).
            kv: the MTP's own one-layer KV memory (layer index 0).
            logits_rows: ``[M]`` int64 rows that need logits.

        Returns:
            ``(logits [M, V] float32, hidden_out [N, H])``: the draft logits and every row's hidden
            state after ``shared_head_norm`` (what a chained draft feeds back).
        """
        m, cfg = self.model, self.model.cfg
        eps = cfg.rms_eps
        ids = input_ids.to(m.device)
        e = m.norm(m.embed(ids), self.enorm, eps)  # [N, H] enorm(tok_embd[token])
        h = m.norm(hidden.to(device=m.device, dtype=m.dtype), self.hnorm, eps)  # [N, H] hnorm(hidden)
        x = m.ops.linear(torch.cat([e, h], dim=-1), self.eh_proj)  # [N, H] eh_proj([e | h])
        x = self.block.forward(x, m.step_inputs(attn, kv), 0, None)  # [N, H] one attention block, KV layer 0
        out = m.norm(x, self.head_norm, eps)  # [N, H] shared_head_norm (t_h_nextn)
        logits = m.ops.linear(out[logits_rows.to(m.device)], m.output).float()  # [M, V] shared lm head
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap  # [M, V]
        return logits, out
