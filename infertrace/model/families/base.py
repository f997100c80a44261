"""What every model family shares: the settings ledger and the common GGUF / HF fields.

Each config key that can change the forward pass ends up in the ledger as ``honoured``,
``not applicable`` or ``refused`` (``inspect`` prints it; the loader refuses to run a model
with any ``refused`` row). Field names follow llama.cpp ``src/llama-arch.cpp``
(``LLM_KV_*``, ``{arch}.attention.head_count`` ...) and HF ``PretrainedConfig``.
"""

from __future__ import annotations

import re

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from infertrace.errors import InfertraceError
from infertrace.fmt import short
from infertrace.model.config import DEFAULT_ROPE_THETA, RopeScaling

HONOURED, NOT_APPLICABLE, REFUSED = "honoured", "not applicable", "refused"

#: GGUF keys under ``{arch}.`` that never change the math (display or sizing only).
GGUF_HARMLESS = {
    "context_length": "trained context length; the run's context is --ctx-size",
    "vocab_size": "rows of token_embd (checked against the tensor)",
    "rope.scaling.finetuned": "training fact, no effect on the forward pass",
    "rope.scaling.original_context_length": "used only by yarn/dynamic scaling",
    "attention.value_length": "must equal key_length (checked)",
}


@dataclass(frozen=True)
class Family:
    """One model family: where its settings live, which decoder features it switches on, and the
    load-time conversions its files need (each a hook: the loader and decoder never ask which family).

    Attributes:
        name: family name (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma3``, ``qwen35``).
        gguf_archs: ``general.architecture`` values it reads (llama.cpp ``LLM_ARCH_*``).
        hf_archs / hf_model_types: ``config.json`` ``architectures`` / ``model_type`` values.
        gguf_rope_pairing: ``"norm"`` when llama.cpp's converter permutes Q/K rows (and biases)
            for adjacent-pair RoPE, ``"neox"`` when the file keeps HF's half-split order.
        hf_layer_names: HF sub-module name -> engine tensor name (llama.cpp's ``blk.N.*`` names).
        from_gguf / from_hf: ``(fields, ledger, tensor names) -> ModelConfig kwargs``.
        features: one line per feature and where the trace shows it (docs/model-families.md / inspect).
        block_names: decoder slot -> this family's tensor name where it differs from llama.cpp's
            default (:mod:`infertrace.model.layout`).
        hf_tie_default: ``tie_word_embeddings`` when config.json omits it (HF's per-family default).
        hf_text_config: ``config.json`` -> its text-decoder part (multimodal layouts), or None.
        hf_key: HF state-dict key -> the key :func:`hf_to_engine_name` maps (layout aliases), or None.
        hf_bare_names: bare HF parameters (no ``.weight``; key after ``layers.N.``) -> engine names.
        hf_skip: ``(config, HF key)`` -> why it is not loaded (None: load it), or None when everything is loaded.
        hf_name: ``(config, HF key)`` -> engine name for keys whose name depends on the config (Qwen3.5's
            ``mtp.*`` -> ``blk.{n_layer}.*``), None to fall back to :func:`hf_to_engine_name`; or None.
        gguf_weights: ``(config, weights)`` in place after dequantisation and the Q/K un-permutation.
        hf_weights: ``(config, weights) -> weights`` converting HF tensors into the convention the
            decoder runs (llama.cpp's converter's), or None.
        load_notes: ``(config, source, config.json or GGUF metadata) -> notes`` for the trace.
    """

    name: str
    gguf_archs: tuple[str, ...]
    hf_archs: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_rope_pairing: str
    hf_layer_names: dict[str, str]
    from_gguf: Callable[..., dict[str, Any]] | None
    from_hf: Callable[..., dict[str, Any]]
    features: tuple[str, ...] = ()
    block_names: dict[str, str] = field(default_factory=dict)
    hf_tie_default: bool = False
    hf_text_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    hf_key: Callable[[str], str] | None = None
    hf_bare_names: dict[str, str] = field(default_factory=dict)
    hf_skip: Callable[[Any, str], str | None] | None = None
    hf_name: Callable[[Any, str], str | None] | None = None
    gguf_weights: Callable[[Any, dict[str, Any]], None] | None = None
    hf_weights: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    load_notes: Callable[[Any, str, dict[str, Any]], list[str]] | None = None


#: HF decoder-layer sub-modules of the Llama layout -> llama.cpp tensor names.
LLAMA_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _short(v: Any) -> str:
    return short(v, 60, tail="...")


@dataclass
class Ledger:
    """Collects ``(key, value, status, note)`` rows in the order they are decided."""

    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def add(self, key: str, value: Any, status: str, note: str = "") -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        self.rows.append((key, _short(value), status, note))

    def honour(self, key: str, value: Any, note: str = "") -> None:
        self.add(key, value, HONOURED, note)

    def na(self, key: str, value: Any, note: str = "") -> None:
        self.add(key, value, NOT_APPLICABLE, note)

    def refuse(self, key: str, value: Any, note: str) -> None:
        self.add(key, value, REFUSED, note)


#: why a sliding window of 0 is refused (issue 23, X9): it is not "no window"
ZERO_WINDOW = ("a window of 0 keys hides every key, the query's own included (HF's mask: kv_idx > q_idx - 0; "
               "llama.cpp's: p1 - p0 >= n_swa), so the windowed layers would attend to nothing; use a window >= 1, "
               "or null / no key for full attention")


def refuse_zero_window(led: Ledger, key: str, w: Any) -> bool:
    """Record ``key = 0`` as refused (:data:`ZERO_WINDOW`) and return True; False for any other value."""
    if w is not None and not isinstance(w, bool) and w == 0:
        led.refuse(key, 0, ZERO_WINDOW)
        return True
    return False


class Fields:
    """Typed access to one ``{arch}.*`` GGUF header or an HF config dict, recording what is read."""

    def __init__(self, src: dict[str, Any], prefix: str, ledger: Ledger, where: str):
        self.src, self.prefix, self.ledger, self.where = src, prefix, ledger, where

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def has(self, name: str) -> bool:
        return self.src.get(self.key(name)) is not None

    def get(self, name: str, default: Any = None) -> Any:
        v = self.src.get(self.key(name))
        return default if v is None else v

    def req(self, name: str) -> Any:
        v = self.src.get(self.key(name))
        if v is None:
            raise InfertraceError(f"{self.where} is missing required key {self.key(name)!r}; the checkpoint is incomplete")
        return v

    def num(self, name: str, default: Any = None, kind: type = float) -> Any:
        v = self.get(name, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InfertraceError(f"{self.where}: {self.key(name)} must be a number, got {_short(v)}")
        v = kind(v)
        if isinstance(v, float) and not math.isfinite(v):
            raise InfertraceError(f"{self.where}: {self.key(name)} must be finite, got {v}")
        return v


# ----------------------------------------------------------------------------- GGUF


def gguf_rope_scaling(f: Fields, led: Ledger) -> RopeScaling:
    """``{arch}.rope.scaling.*`` and the legacy ``{arch}.rope.scale_linear`` as llama.cpp's
    ``load_hparams`` reads them: the factor comes from ``rope.scaling.factor`` or else
    ``rope.scale_linear``; a factor without ``rope.scaling.type`` means ``linear``.
    Refuses types the engine does not implement."""
    factor = f.num("rope.scaling.factor")
    fkey = f.key("rope.scaling.factor")
    if factor is None and f.has("rope.scale_linear"):
        factor, fkey = f.num("rope.scale_linear"), f.key("rope.scale_linear")
    stype = str(f.get("rope.scaling.type", "") or "")
    orig = f.num("rope.scaling.original_context_length", 0, int) or 0
    if not stype:
        stype = "linear" if factor not in (None, 0.0, 1.0) else "none"
        if factor is not None:
            led.honour(fkey, factor, "no rope.scaling.type: linear, as llama.cpp's loader assumes" if stype == "linear"
                       else "factor 1: no scaling")
    else:
        led.honour(f.key("rope.scaling.type"), stype) if stype in ("none", "linear", "yarn") else None
        if factor is not None:
            led.honour(fkey, factor)
    if stype not in ("none", "linear", "yarn"):
        led.refuse(f.key("rope.scaling.type"), stype, "RoPE scaling type not implemented (none, linear, yarn)")
        return RopeScaling()
    if factor is not None and factor <= 0:
        led.refuse(fkey, factor, "RoPE scaling factor must be > 0")
        return RopeScaling()
    if stype == "none":
        return RopeScaling()
    if stype == "yarn":
        return RopeScaling(type="yarn", factor=float(factor or 1.0), original_max_position_embeddings=orig or 0,
                           beta_fast=float(f.num("rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(f.num("rope.scaling.yarn_beta_slow", 1.0)),
                           attn_factor=(f.num("rope.scaling.attn_factor", 1.0)) * (1.0 + 0.1 * math.log(factor) if factor and factor > 1 else 1.0))
    return RopeScaling(type="linear", factor=float(factor or 1.0), original_max_position_embeddings=orig or 8192)


def gguf_common(meta: dict[str, Any], arch: str, led: Ledger) -> tuple[dict[str, Any], Fields]:
    """Shape, RoPE and norm fields every llama.cpp decoder arch has (``load_hparams`` common part).

    Returns the :class:`~infertrace.model.config.ModelConfig` keyword arguments and the field reader.
    """
    f = Fields(meta, f"{arch}.", led, "GGUF")
    n_embd = int(f.req("embedding_length"))
    n_head = f.req("attention.head_count")
    if isinstance(n_head, (list, tuple)):
        led.refuse(f.key("attention.head_count"), n_head, "per-layer head counts are not implemented")
        n_head = n_head[0] if n_head else 1
    n_head = int(n_head)
    if n_head <= 0:
        raise InfertraceError(f"{arch}.attention.head_count is {n_head}; the model file is broken")
    n_head_kv = f.get("attention.head_count_kv", n_head)
    if isinstance(n_head_kv, (list, tuple)):
        led.refuse(f.key("attention.head_count_kv"), n_head_kv, "per-layer KV head counts are not implemented")
        n_head_kv = n_head_kv[0] if n_head_kv else n_head
    head_dim = f.num("attention.key_length", n_embd // n_head, int)
    vlen = f.num("attention.value_length", head_dim, int)
    if vlen != head_dim:
        led.refuse(f.key("attention.value_length"), vlen, f"value head size differs from key_length {head_dim}; not implemented")
    rope_dim = f.num("rope.dimension_count", head_dim, int)
    theta = f.num("rope.freq_base")
    eps = f.num("attention.layer_norm_rms_epsilon", 1e-5)
    for k in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
              "attention.key_length"):
        if f.has(k):
            led.honour(f.key(k), f.get(k))
    led.honour(f.key("rope.freq_base"), theta if theta is not None else f"absent (default {DEFAULT_ROPE_THETA:g})")
    led.honour(f.key("attention.layer_norm_rms_epsilon"), eps)
    if rope_dim != head_dim:
        led.refuse(f.key("rope.dimension_count"), rope_dim, f"partial rotary ({rope_dim} of {head_dim} dims) is not implemented for {arch}")
    else:
        led.honour(f.key("rope.dimension_count"), rope_dim)
    if f.has("attention.layer_norm_epsilon"):
        led.refuse(f.key("attention.layer_norm_epsilon"), f.get("attention.layer_norm_epsilon"),
                   "LayerNorm (with mean) is not implemented; only RMSNorm")
    ec = f.get("expert_count")
    if ec:
        led.refuse(f.key("expert_count"), ec, "mixture-of-experts is not implemented")
    elif ec is not None:
        led.na(f.key("expert_count"), ec, "0 experts: dense FFN")
    kw = dict(
        n_layer=int(f.req("block_count")), n_embd=int(n_embd), n_ff=int(f.req("feed_forward_length")),
        n_head=n_head, n_head_kv=int(n_head_kv), head_dim=int(head_dim),
        n_ctx_train=int(f.num("context_length", 2048, int)),
        rope_theta=float(theta) if theta is not None else DEFAULT_ROPE_THETA, rope_theta_is_default=theta is None,
        rope_dim=int(rope_dim), rms_eps=float(eps), rope_scaling=gguf_rope_scaling(f, led),
    )
    return kw, f


def gguf_unknown_keys(meta: dict[str, Any], arch: str, led: Ledger) -> None:
    """Every ``{arch}.*`` key not decided yet: harmless ones are ``not applicable``, the rest refused
    (a key the engine does not know may change the math)."""
    for k in sorted(meta):
        if not k.startswith(f"{arch}.") or k in led.seen:
            continue
        sub = k[len(arch) + 1 :]
        if sub in GGUF_HARMLESS:
            led.na(k, meta[k], GGUF_HARMLESS[sub])
        elif sub.startswith("rope.scaling.yarn_") or sub == "rope.scaling.attn_factor":
            led.na(k, meta[k], "yarn parameter; used only with rope.scaling.type yarn")
        else:
            led.refuse(k, meta[k], "setting unknown to infertrace for this architecture; it may change the forward pass")


# ----------------------------------------------------------------------------- HF

#: config.json keys of other families that change the math; refused when set to a non-neutral value.
HF_FOREIGN = {
    "partial_rotary_factor": (1.0, "partial rotary is not implemented for this family"),
    "attn_logit_softcapping": (None, "attention logit soft-capping is not implemented"),
    "logits_scaling": (1.0, "logit scaling (granite) is not implemented"),
    "embedding_multiplier": (1.0, "embedding multiplier (granite) is not implemented"),
    "residual_multiplier": (1.0, "residual multiplier (granite) is not implemented"),
    "attention_multiplier": (None, "attention multiplier (granite) is not implemented"),
    "use_bidirectional_attention": (False, "bidirectional attention is not implemented"),
    "num_experts": (None, "mixture-of-experts is not implemented"),
    "num_local_experts": (None, "mixture-of-experts is not implemented"),
    "qk_layernorm": (False, "QK LayerNorm is not implemented for this family"),
    "use_qk_norm": (False, "QK norm is not implemented for this family"),
    "no_rope_layers": (None, "layers without RoPE are not implemented"),
    "layer_norm_eps": (None, "LayerNorm is not implemented; only RMSNorm"),
}

ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def hf_act(cfg: dict[str, Any], led: Ledger, default: str, allowed: tuple[str, ...]) -> str:
    """``hidden_act`` (or ``hidden_activation``) -> ``"silu"`` / ``"gelu_tanh"``; refused when unknown."""
    key = "hidden_activation" if cfg.get("hidden_activation") is not None else "hidden_act"
    raw = cfg.get(key, default)
    act = ACTS.get(str(raw))
    if act is None or act not in allowed:
        led.refuse(key, raw, f"activation not implemented for this family (supported: {', '.join(k for k, v in ACTS.items() if v in allowed)})")
        return allowed[0]
    led.honour(key, raw, "SwiGLU: down(silu(gate) * up)" if act == "silu" else "GeGLU: down(gelu_tanh(gate) * up)")
    return act


def hf_rope_params(cfg: dict[str, Any], layer_type: str | None = None) -> tuple[dict[str, Any], str]:
    """The RoPE parameter dict (HF 4.x ``rope_scaling`` or 5.x ``rope_parameters``, optionally per
    layer type) and the key it came from."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and layer_type and isinstance(rp.get(layer_type), dict):
        return rp[layer_type], f"rope_parameters.{layer_type}"
    if isinstance(cfg.get("rope_scaling"), dict):
        return cfg["rope_scaling"], "rope_scaling"
    if isinstance(rp, dict) and not any(isinstance(v, dict) for v in rp.values()):
        return rp, "rope_parameters"
    return {}, "rope_scaling"


def hf_rope_scaling(rs: dict[str, Any], key: str, led: Ledger, allowed=("linear", "llama3", "yarn", "dynamic")) -> RopeScaling:
    """HF ``rope_scaling`` dict -> :class:`RopeScaling`; refused when the type is not implemented."""
    rtype = str(rs.get("rope_type", rs.get("type", "default")) or "default")
    if rtype in ("default", "none"):
        if rs:
            led.honour(f"{key}.rope_type", rtype, "plain RoPE")
        return RopeScaling()
    if rtype not in allowed:
        led.refuse(f"{key}.rope_type", rtype, f"RoPE scaling type not implemented (supported: {', '.join(allowed)})")
        return RopeScaling()
    led.honour(f"{key}.rope_type", rtype, f"factor {rs.get('factor', 1.0)}")
    try:
        return RopeScaling(
            type=rtype, factor=float(rs.get("factor", 1.0)),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)), high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings") or 0) or (8192 if rtype != "yarn" else 0),
            beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
            attn_factor=(float(rs["attention_factor"]) if rs.get("attention_factor") is not None else None),
            mscale=float(rs.get("mscale") or 0.0), mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0),
            truncate=bool(rs.get("truncate", True)),
        )
    except (TypeError, ValueError):
        raise InfertraceError(f"config.json {key} has a non-numeric value; fix the checkpoint's config") from None


def hf_common(cfg: dict[str, Any], led: Ledger, eps_default: float = 1e-5) -> dict[str, Any]:
    """Shape, RoPE and norm fields of an HF decoder ``config.json`` (``eps_default``: the family's
    ``rms_norm_eps`` when the file omits it)."""
    try:
        n_embd = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        n_layer = int(cfg["num_hidden_layers"])
        n_ff = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except KeyError as e:
        raise InfertraceError(f"config.json is missing {e.args[0]!r}; the checkpoint is incomplete") from None
    if n_head <= 0:
        raise InfertraceError(f"num_attention_heads is {n_head}; the checkpoint's config is broken")
    head_dim = int(cfg.get("head_dim") or n_embd // n_head)
    rs, rkey = hf_rope_params(cfg, "full_attention")
    theta = cfg.get("rope_theta", rs.get("rope_theta"))
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
              "head_dim", "rms_norm_eps", "tie_word_embeddings"):
        if k in cfg:
            led.honour(k, cfg[k])
    led.honour("rope_theta", theta if theta is not None else f"absent (default {DEFAULT_ROPE_THETA:g})")
    for k, (neutral, note) in HF_FOREIGN.items():
        if k in cfg and cfg[k] is not None and cfg[k] != neutral and cfg[k] is not False:
            led.refuse(k, cfg[k], note)
    if "pretraining_tp" in cfg:
        led.na("pretraining_tp", cfg["pretraining_tp"], "tensor-parallel slicing in training; same math")
    return dict(
        n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
        n_head_kv=int(cfg.get("num_key_value_heads") or n_head), head_dim=head_dim, vocab_size=vocab,
        n_ctx_train=int(cfg.get("max_position_embeddings") or 2048),
        rope_theta=float(theta) if theta is not None else DEFAULT_ROPE_THETA, rope_theta_is_default=theta is None,
        rope_dim=head_dim, rms_eps=float(cfg.get("rms_norm_eps") or eps_default),
        rope_scaling=hf_rope_scaling(rs, rkey, led),
    )


def hf_window_layers(cfg: dict[str, Any], n_layer: int, led: Ledger, default_types: list[str]) -> tuple[bool, ...]:
    """Per-layer ``sliding_attention`` flags from ``layer_types`` (HF 5.x) or the family default."""
    lt = cfg.get("layer_types")
    if lt is None:
        lt = default_types
    elif not isinstance(lt, list) or len(lt) != n_layer or any(t not in ("sliding_attention", "full_attention") for t in lt):
        led.refuse("layer_types", lt, f"must list {n_layer} entries of sliding_attention / full_attention")
        return tuple(False for _ in range(n_layer))
    else:
        led.honour("layer_types", f"{sum(t == 'sliding_attention' for t in lt)} sliding of {n_layer}")
    return tuple(t == "sliding_attention" for t in lt)


_LAYER_NUMBER = re.compile(r"[0-9]{1,9}")


def layer_number(part: str) -> int | None:
    """The layer index written in a tensor name's layer field (``blk.<N>.…``, ``layers.<N>.…``):
    1 to 9 ASCII digits, else None. ``str.isdigit``/``int`` would take ``²`` (then fail) or Arabic-Indic
    digits (an alias of a real layer), which are names no runtime writes."""
    return int(part) if _LAYER_NUMBER.fullmatch(part) else None
