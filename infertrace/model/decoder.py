"""One decoder skeleton for every family: embeddings -> blocks -> final norm -> lm head, over a packed batch.

Mirrors llama.cpp ``src/models/{llama,qwen2,qwen3,gemma3,qwen35}.cpp`` and HF ``modeling_*.py``:
``build_inp_embd`` (x sqrt(H) when ``embed_scale``) -> per layer ``x + mixer(norm(x))`` then
``x + ffn(norm(x))`` (:class:`~infertrace.model.layers.Block`; the mixer per layer from
``layer_types``: attention or Gated DeltaNet) -> final norm -> lm head for the rows that need logits
(-> soft-cap). Which features a model has is data in its :class:`ModelConfig` (set by its family,
:mod:`infertrace.model.families`); nothing here asks which family it runs. Only the current tokens
are computed; history lives in the memory (``kv``). Every linear layer goes through ``self.ops``
(:mod:`infertrace.model.ops`); the taps it fires are :mod:`infertrace.model.taps`.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from infertrace.errors import InfertraceError
from infertrace.model.config import ModelConfig
from infertrace.model.families import family_of
from infertrace.model.layers import ACTIVATIONS, Block, Step, build_block, norm_of, on_device
from infertrace.model.ops import TORCH_OPS, Ops
from infertrace.model.rope import cos_sin, inv_freq_f32, rope_attention_factor
from infertrace.model.taps import EMBED, NULL_TRACER, Tracer, layer_taps

if TYPE_CHECKING:
    from infertrace.kv.base import AttnInputs, KVBackend


class DecoderModel:
    """Engine-side weights (typed blocks, Q/K/V and gate/up fused) and the forward pass of any supported family.

    Args:
        config: the frozen :class:`ModelConfig` (its features decide the optional steps).
        weights: engine-named tensors from :func:`infertrace.loading.weights.load_checkpoint`
            (Q/K in half-split order; zero-centred norms already ``1 + w``).
        device: torch device for compute.
        ops: the linear-op implementation (:class:`~infertrace.model.ops.Ops`; default ``F.linear``).

    Attributes:
        layers: one :class:`~infertrace.model.layers.Block` per layer (a layer-skip draft keeps a prefix).
        tok_embd ``[V, H]``, output ``[V, H]`` (tied: the same tensor), output_norm ``[H]``; the
        embedding table and the head may be weight objects (:class:`~infertrace.model.ops.LinearWeight`).

    Raises:
        InfertraceError: the config has a ``refused`` setting, an unknown activation or lacks a tensor
            it implies (no silent math).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, Any], device: str | torch.device = "cpu",
                 ops: Ops = TORCH_OPS):
        if config.refusals:
            raise InfertraceError(f"{config.refusals[0]}; infertrace refuses to run math it would get wrong")
        if config.act not in ACTIVATIONS:
            raise InfertraceError(f"activation {config.act!r} is not implemented (supported: {', '.join(ACTIVATIONS)})")
        self.cfg = config
        self.device = dev = torch.device(device)
        self.ops = ops
        w = weights
        self.dtype = w["output_norm"].dtype  # the compute dtype (every float tensor of a checkpoint has it)
        self.tok_embd = on_device(w["token_embd"], dev)  # [V, H]
        self.output = on_device(w.get("output", w["token_embd"]), dev)  # [V, H] (tied when absent)
        self.output_norm = w["output_norm"].to(dev)  # [H]
        self.norm = norm_of(config)
        names = family_of(config).block_names
        self.layers: list[Block] = [build_block(config, w, il, names, ops, dev) for il in range(config.n_layer)]
        self.inv_freq = inv_freq_f32(config)  # [rope_dim/2] float32 (full-attention layers)
        self.inv_freq_swa = (inv_freq_f32(config, swa=True) if config.windowed_layers and config.rope_theta_swa is not None
                             else self.inv_freq)  # [rope_dim/2] float32 (sliding-window layers)
        self.rope_mscale = rope_attention_factor(config)  # yarn's cos/sin factor (1.0 otherwise)
        self.scale = config.softmax_scale
        self.embed_scale = (torch.tensor(config.embed_scale, dtype=self.dtype, device=dev)
                            if config.embed_scale is not None else None)  # scalar, model dtype (as HF)
        self.mtp = None  # the MTP draft head (model/mtp.py) when the checkpoint carries one; never run by forward()
        if config.mtp_layers:
            from infertrace.model.mtp import MTPHead

            self.mtp = MTPHead(self, w)

    def with_ops(self, ops: Ops) -> "DecoderModel":
        """The same model (weights shared, not copied) computing its linear layers with ``ops``."""
        m = copy.copy(self)
        m.ops = ops
        return m

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn: AttnInputs, kv: KVBackend, logits_rows: torch.Tensor,
                tracer: Tracer = NULL_TRACER, hidden_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One step over the packed batch.

        Args:
            input_ids: ``[N]`` int64 current token ids (packed, request after request).
            attn: the memory's :class:`AttnInputs` for this step (positions ``[N]`` inside).
            kv: the memory (written with current K/V, read for attention; it applies each
                layer's sliding window; GDN layers advance its recurrent state).
            logits_rows: ``[M]`` int64 rows of the packed batch that need logits
                (last prompt token of a finished prefill, each decode token).
            tracer: tap observer; ``embed`` every step, the block taps (:data:`~infertrace.model.taps.BLOCK_TAPS`)
                it subscribes to for the layers in ``tracer.layers``.
            hidden_out: when a list, every row's last hidden state after the final norm ``[N, H]`` is
                appended to it (llama.cpp ``t_h_nextn``, the MTP draft head's input); the logits are unchanged.

        Returns:
            ``[M, vocab]`` float32 logits.
        """
        ids = input_ids.to(self.device)
        x = self.embed(ids)  # [N, H]
        if tracer.enabled:
            tracer.tap(EMBED, value=x, ids=ids)
        s = self.step_inputs(attn, kv)
        if tracer.enabled:
            for il, block in enumerate(self.layers):
                x = block.forward(x, s, il, layer_taps(tracer, il))  # [N, H]
        else:
            for il, block in enumerate(self.layers):
                x = block.forward(x, s, il, None)  # [N, H]
        if hidden_out is not None:
            hidden_out.append(self.norm(x, self.output_norm, self.cfg.rms_eps))  # [N, H] after output_norm
        return self.head(x[logits_rows.to(self.device)])  # [M, V]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[N, H]`` of ``ids`` ``[N]`` (x ``embed_scale`` in the model dtype: Gemma's sqrt(H))."""
        x = self.ops.embed(self.tok_embd, ids)  # [N, H]
        if self.embed_scale is not None:
            x = x * self.embed_scale  # [N, H]
        return x

    def step_inputs(self, attn: AttnInputs, kv: KVBackend) -> Step:
        """What every layer of this step shares: the RoPE tables of the step's positions, ops, memory.

        Raises:
            InfertraceError: a position reaches ``n_ctx_train`` of a ``dynamic`` RoPE model.
        """
        cfg = self.cfg
        pos = attn.positions.to(self.device)
        if cfg.rope_scaling.type == "dynamic" and pos.numel() and int(pos.max()) >= cfg.n_ctx_train:
            raise InfertraceError(f"position {int(pos.max())} reaches max_position_embeddings {cfg.n_ctx_train} of a 'dynamic' "
                                  "RoPE model: HF rescales the base per forward there (stateful), which infertrace does not "
                                  "implement; keep prompts + new tokens below it")
        rope = cos_sin(pos, self.inv_freq.to(self.device), self.dtype, self.rope_mscale)  # [N, rope_dim/2] each
        rope_swa = (rope if self.inv_freq_swa is self.inv_freq else
                    cos_sin(pos, self.inv_freq_swa.to(self.device), self.dtype))  # [N, rope_dim/2] each
        return Step(cfg, self.ops.linear, self.norm, attn, kv, rope, rope_swa, self.scale)

    def head(self, xs: torch.Tensor) -> torch.Tensor:
        """Final norm, lm head and soft-cap of the rows that need logits: ``[M, H]`` -> ``[M, V]`` float32."""
        cfg = self.cfg
        xs = self.norm(xs, self.output_norm, cfg.rms_eps)  # [M, H]
        logits = self.ops.linear(xs, self.output).float()  # [M, V]
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap  # [M, V]
        return logits
