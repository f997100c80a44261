"""The ``run`` options other commands repeat (``dump-kv``, ``diff-backends``): one Annotated alias
per option, and :func:`build_run_inputs`, which validates them exactly as ``run`` does and
returns the prompt specs and engine options. Typer needs each option in the command's own
signature, so commands list the aliases; the help texts and checks live here once.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from infertrace.cli.common import ATTENTION, BACKENDS, DEVICES, check_choice, check_min, read_prompts_file
from infertrace.engine.options import EngineOptions, SamplingParams
from infertrace.errors import InfertraceError

if TYPE_CHECKING:
    from infertrace.runner import PromptSpec

Prompt = Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="Prompt text; repeat for several requests (seq 0, 1, ...).")]
Prompts = Annotated[Optional[Path], typer.Option("--prompts", help="JSONL file, one {\"prompt\": ..., \"arrival\": ..., sampling keys} per line.")]
Model = Annotated[Optional[Path], typer.Option("--model", "-m", help="GGUF file, HF model directory, or a model name: smollm2-135m (default), gemma3-270m.")]
Arrival = Annotated[Optional[list[int]], typer.Option("--arrival", help="Step at which each --prompt arrives; one per --prompt.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate per request.")]
Chat = Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the model's chat template.")]
Temperature = Annotated[float, typer.Option("--temperature", help="0 = greedy.")]
TopK = Annotated[int, typer.Option("--top-k", help="0 = off.")]
TopP = Annotated[float, typer.Option("--top-p", help="1 = off.")]
MinP = Annotated[float, typer.Option("--min-p", help="0 = off.")]
RepetitionPenalty = Annotated[float, typer.Option("--repetition-penalty", help="1 = off.")]
PenaltyLastN = Annotated[Optional[int], typer.Option("--penalty-last-n", help="Penalties see the last N tokens, prompt included (llama.cpp --repeat-last-n): -1 = the whole context, 0 = off. Default: 64 in the llama.cpp order (llama.cpp's default), the whole context in the hf order (HF, vLLM).", show_default=False)]
FrequencyPenalty = Annotated[float, typer.Option("--frequency-penalty", help="Subtract count x this from each token in the penalty window (llama.cpp penalties sampler; --sampler-order llama.cpp). 0 = off.")]
PresencePenalty = Annotated[float, typer.Option("--presence-penalty", help="Subtract this from each token in the penalty window (llama.cpp penalties sampler; --sampler-order llama.cpp). 0 = off.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of each request's sampler.")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Keep generating after an end-of-generation token.")]
Backend = Annotated[str, typer.Option("--backend", help="KV cache / attention convention: cells (llama.cpp) or paged (TensorRT-LLM/vLLM).")]
CtxSize = Annotated[Optional[int], typer.Option("--ctx-size", help=f"KV capacity and per-request context limit, in tokens (default {EngineOptions.ctx_size}, or the model's trained context when that is smaller).", show_default=False)]
NumBlocks = Annotated[Optional[int], typer.Option("--num-blocks", help="paged: blocks in the pool (default ctx-size / tokens-per-block).")]
TokensPerBlock = Annotated[int, typer.Option("--tokens-per-block", help="paged: slots per block.")]
MaxBatchTokens = Annotated[int, typer.Option("--max-batch-tokens", help="Scheduler token budget per step.")]
PrefillChunk = Annotated[Optional[int], typer.Option("--prefill-chunk", help="Max prompt tokens per request per step (chunked prefill).")]
Attention = Annotated[str, typer.Option("--attention", help="Attention implementation: torch, triton (paged only) or auto.")]
Dtype = Annotated[str, typer.Option("--dtype", help="Compute dtype: float32, bfloat16 or float16.")]
KvDtype = Annotated[Optional[str], typer.Option("--kv-dtype", help="K/V cache storage type: f32, f16 or bf16 (llama.cpp's cache types; its default is f16). Attention reads the values back in --dtype. Default: --dtype.", show_default=False)]
Device = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
Weights = Annotated[str, typer.Option("--weights", help="GGUF weights: float (dequantised at load, the reference), quant (kept quantised, a kernel per tensor type) or auto (quant for a GGUF in bfloat16 on the CPU, where it measured faster).")]
Threads = Annotated[Optional[int], typer.Option("--threads", help="CPU threads for torch (default: the cores available now: affinity, cgroup quota, minus cores busy elsewhere).", show_default=False)]
SamplerOrder = Annotated[Optional[str], typer.Option("--sampler-order", help="hf (temperature, then top-k/top-p/min-p: HF, vLLM) or llama.cpp (top-k/top-p/min-p on unscaled logits, temperature last: common_sampler). Default: the convention of the runtime mirrored (cells and --runtime llama.cpp: llama.cpp; paged: hf).")]
Padding = Annotated[Optional[str], typer.Option("--padding", help="With --runtime hf: pad the batch on the left (default, as generate() wants for decoder-only models) or on the right; the trace shows the padded [B, T] layout.", show_default=False)]
LlamacppFlashAttn = Annotated[Optional[str], typer.Option("--llamacpp-flash-attn", help="With llama.cpp computing: its flash attention, auto (llama.cpp's default: on where supported), on or off. It changes llama.cpp's numbers; the trace header records what ran.", show_default=False)]
TensorParallelSize = Annotated[int, typer.Option("--tensor-parallel-size", help="With --runtime vllm: tensor-parallel ranks, through vLLM's own distributed executor (each rank holds n_kv_heads / N).")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (nothing else).")]
KvUnified = Annotated[str, typer.Option("--kv-unified", help="cells: on = one cell stream shared by every sequence (llama.cpp kv_unified = true); off = one stream of ctx-size / n-requests cells per sequence, kq_mask ne[3] = the ubatch's streams, each step one split_equal ubatch (llama.cpp's default).")]
# serving mechanisms (engine/serving.py)
PrefixCache = Annotated[str, typer.Option("--prefix-cache", help="on: reuse cached K/V of a shared prompt prefix (paged: hashed full blocks; cells: seq_cp of a live or finished sequence).")]
ContextShift = Annotated[bool, typer.Option("--context-shift", help="When a request fills --ctx-size, drop cached tokens after --n-keep and continue (llama.cpp server), instead of stopping with ctx_full.")]
NKeep = Annotated[int, typer.Option("--n-keep", help="Context shift: cached tokens kept at the start (-1 = the whole prompt, as llama.cpp's --keep -1).")]
NDiscard = Annotated[int, typer.Option("--n-discard", help="Context shift: tokens dropped after --n-keep (0 = half of the rest).")]
AuditKv = Annotated[bool, typer.Option("--audit-kv", help="Record each cached K/V entry's provenance and recompute the cache from scratch every step (max |Δ| per provenance).")]

# speculative decoding (engine/speculative.py)
Speculative = Annotated[Optional[str], typer.Option("--speculative", help="Speculative decoding: ngram (prompt lookup, as llama.cpp lookup / vLLM ngram), draft (a draft model: --draft-model or --draft-layers) or mtp (the model's own MTP head: Qwen3.5 mtp.* / GGUF nextn tensors). Default off.")]
NumSpecTokens = Annotated[int, typer.Option("--num-spec-tokens", help="Speculative: K draft tokens per step (a chain).")]
SpecTree = Annotated[Optional[str], typer.Option("--spec-tree", help="Speculative: a static draft tree instead of a chain, as the parent index of each draft node (-1 = the last accepted token), e.g. -1,-1,0,0,1. Greedy only.")]
DraftModel = Annotated[Optional[str], typer.Option("--draft-model", help="Speculative draft: the draft model file (same vocabulary as the target).")]
DraftLayers = Annotated[Optional[int], typer.Option("--draft-layers", help="Speculative draft: the target's own first k layers as the draft model (layer skip).")]
NgramMin = Annotated[int, typer.Option("--ngram-min", help="Speculative ngram: shortest suffix looked up.")]
NgramMax = Annotated[int, typer.Option("--ngram-max", help="Speculative ngram: longest suffix looked up.")]

D = SamplingParams  # defaults
E = EngineOptions

#: the ``run`` flag of each engine config field a :class:`~infertrace.engine.config.ConfigError` names
#: (``infertrace.cli.app.report_error`` prints ``error: <flag>: <reason>``; a test checks both directions)
CONFIG_FLAGS = {
    "cache.backend": "--backend", "cache.ctx_size": "--ctx-size", "cache.num_blocks": "--num-blocks",
    "cache.tokens_per_block": "--tokens-per-block", "cache.n_seq_max": "--prompt", "cache.kv_unified": "--kv-unified",
    "cache.kv_dtype": "--kv-dtype",
    "scheduler.max_batch_tokens": "--max-batch-tokens", "scheduler.prefill_chunk": "--prefill-chunk",
    "speculative.method": "--speculative", "speculative.num_spec_tokens": "--num-spec-tokens",
    "speculative.spec_tree": "--spec-tree", "speculative.draft_model": "--draft-model",
    "speculative.draft_layers": "--draft-layers", "speculative.ngram_min": "--ngram-min",
    "speculative.ngram_max": "--ngram-max",
    "serving.prefix_cache": "--prefix-cache", "serving.context_shift": "--context-shift", "serving.n_keep": "--n-keep",
    "serving.n_discard": "--n-discard", "serving.audit_kv": "--audit-kv",
    "attention": "--attention", "sampler_order": "--sampler-order",
    "run.layer": "--layer", "run.tensor_layers": "--layers", "run.show": "--show", "run.prompts": "--prompt",
    "model.dtype": "--dtype", "model.weights": "--weights", "model.device": "--device",
    **{f"sampling.{f}": "--" + f.replace("_", "-") for f in (
        "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
        "penalty_last_n", "seed", "max_new_tokens", "ignore_eos")},
}


def config_error_line(e: Any) -> str:
    """``<flag>: <reason>`` for a :class:`~infertrace.engine.config.ConfigError` (its field when no flag is known)."""
    return f"{CONFIG_FLAGS.get(e.field, e.field)}: {e.reason}"


def build_run_inputs(*, prompt: Optional[list[str]], prompts: Optional[Path], arrival: Optional[list[int]],
                     max_new_tokens: int, chat: bool, temperature: float, top_k: int, top_p: float, min_p: float,
                     repetition_penalty: float, seed: int, ignore_eos: bool, backend: str, ctx_size: int,
                     num_blocks: Optional[int], tokens_per_block: int, max_batch_tokens: int,
                     prefill_chunk: Optional[int], attention: str, dtype: str, device: str,
                     sampler_order: Optional[str] = None,
                     prefix_cache: str = "off", context_shift: bool = False, n_keep: int = 0, n_discard: int = 0,
                     audit_kv: bool = False, penalty_last_n: Optional[int] = None, frequency_penalty: float = 0.0,
                     presence_penalty: float = 0.0, kv_dtype: Optional[str] = None,
                     kv_unified: str = "on") -> tuple[list[PromptSpec], EngineOptions]:
    """Validate ``run``'s options (before any model loads) and build the requests and engine options.

    Returns:
        ``(specs, opts)``: one :class:`PromptSpec` per ``--prompt`` (then per ``--prompts`` line),
        and the :class:`EngineOptions`.

    Raises:
        InfertraceError: any invalid option, with the option's name in the one-line message.
    """
    from infertrace.runner import parse_dtype  # the engine side (torch): only when a run is coming

    backend = check_choice("--backend", backend, BACKENDS)
    if sampler_order is not None:
        from infertrace.engine.sampler import ORDERS

        sampler_order = check_choice("--sampler-order", sampler_order, ORDERS)
    attention = check_choice("--attention", attention, ATTENTION)
    device = check_choice("--device", device, DEVICES)
    parse_dtype(dtype)
    if kv_dtype is not None:
        from infertrace.engine.options import KV_DTYPES

        kv_dtype = check_choice("--kv-dtype", kv_dtype, KV_DTYPES)
    prefix_on = check_choice("--prefix-cache", prefix_cache, ("on", "off")) == "on"
    unified = check_choice("--kv-unified", kv_unified, ("on", "off")) == "on"
    check_min("--seed", seed, 0)
    opts = EngineOptions(backend=backend, ctx_size=ctx_size, num_blocks=num_blocks, tokens_per_block=tokens_per_block,
                         max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk, attention=attention,
                         sampler_order=sampler_order,
                         prefix_cache=prefix_on, context_shift=context_shift, n_keep=n_keep, n_discard=n_discard,
                         audit_kv=audit_kv, kv_dtype=kv_dtype, kv_unified=unified,
                         n_seq_max=EngineOptions.n_seq_max if unified else 1).validate()  # ConfigError: a flag's value
    check_device(attention, backend, device)
    defaults = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "min_p": min_p, "repetition_penalty": repetition_penalty, "seed": seed, "ignore_eos": ignore_eos,
                "penalty_last_n": penalty_last_n, "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty}
    specs = build_specs(prompt, prompts, arrival, defaults, chat, sampler_order, backend)
    check_request_limits(specs, ctx_size, context_shift)
    if not unified:
        opts = kv_streams_options(opts, len(specs))
    return specs, opts


def check_device(attention: str, backend: str, device: str) -> None:
    """``--attention triton`` (paged only, a Triton build for the device) and ``--device cuda`` (CUDA present),
    before the model loads, with the engine's own messages.

    Raises:
        InfertraceError: the attention or device cannot run here.
    """
    if attention == "triton":  # fail before the model loads, with the engine's own messages
        import torch

        from infertrace.attention.select import resolve_attention

        resolve_attention("triton", torch.device(device if device == "cpu" else "cuda"))
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InfertraceError("--device cuda requested but CUDA is not available; use --device cpu")


def build_specs(prompt: Optional[list[str]], prompts: Optional[Path], arrival: Optional[list[int]],
                defaults: dict[str, Any], chat: bool, sampler_order: Optional[str], backend: str) -> list[PromptSpec]:
    """One :class:`PromptSpec` per ``--prompt`` (with its ``--arrival``), then per ``--prompts`` line, sampling
    settings from ``defaults``; each request's penalties checked against the sampler order.

    Raises:
        InfertraceError: ``--arrival`` not one per ``--prompt`` or negative, no prompt, a bad ``--prompts`` line,
            a penalty the order lacks.
    """
    from infertrace.engine.options import check_penalties
    from infertrace.engine.sampler import default_order
    from infertrace.runner import PromptSpec

    params = SamplingParams(**defaults).validate()
    texts = list(prompt or [])
    arrivals = list(arrival or [])
    if arrivals and len(arrivals) != len(texts):
        raise InfertraceError(f"--arrival given {len(arrivals)} time(s) for {len(texts)} --prompt(s); give one per --prompt")
    for a in arrivals:
        check_min("--arrival", a, 0)
    specs = [PromptSpec(t, params, arrivals[i] if arrivals else 0, chat) for i, t in enumerate(texts)]
    if prompts is not None:
        specs += read_prompts_file(prompts, defaults, chat)
    if not specs:
        raise InfertraceError("no prompt given; pass --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    for spec in specs:  # the order's penalties, before a model loads (the engine checks again)
        check_penalties(spec.params, sampler_order or default_order(backend))
    return specs


def kv_streams_options(opts: EngineOptions, n_requests: int) -> EngineOptions:
    """``opts`` for ``--kv-unified off``: one stream per request (``n_seq_max`` = the requests, as
    llama.cpp's ``n_stream = n_seq_max``), ``n_ctx_seq`` cells each (``pad256(pad256(ctx_size) // n_seq_max)``).

    Raises:
        ConfigError: ``ctx_size`` smaller than the number of requests (``cache.ctx_size``).
    """
    import dataclasses

    return dataclasses.replace(opts, kv_unified=False, n_seq_max=max(1, n_requests)).validate()


def run_step_bound(specs: list[PromptSpec], ctx_size: int, context_shift: bool) -> int:
    """An upper bound on the decode steps of a run: the latest arrival plus every request's decode steps
    one after another (no batching). A request without a context shift stops when it fills ``ctx_size``
    (at most ``ctx_size - 1`` new tokens); with one it generates all ``max_new_tokens``."""
    per = [s.params.max_new_tokens if context_shift else min(s.params.max_new_tokens, ctx_size - 1) for s in specs]
    return max((s.arrival_step for s in specs), default=0) + sum(per)


def check_request_limits(specs: list[PromptSpec], ctx_size: int, context_shift: bool) -> None:
    """Each request's recorded fields within the trace schema's limits (``max_new_tokens`` at most ``MAX_CTX``,
    ``top_k`` at most ``MAX_ID``, ``arrival`` at most ``MAX_STEPS``, at most ``MAX_LIST`` requests), and the run's steps (:func:`run_step_bound`) at most ``MAX_STEPS``:
    ``-n 1000000000 --context-shift`` ran for ever and could never be saved.

    Raises:
        InfertraceError: naming the option, the value and the limit.
    """
    from infertrace.trace.schema import LIMITS

    if len(specs) > LIMITS["MAX_LIST"]:
        raise InfertraceError(f"{len(specs)} requests are more than the {LIMITS['MAX_LIST']} a trace holds (MAX_LIST)")
    for s in specs:
        if s.params.top_k > LIMITS["MAX_ID"]:  # a token id bound: larger is "off" in effect, but the trace must hold it
            raise InfertraceError(f"--top-k {s.params.top_k} is over the limit of {LIMITS['MAX_ID']} (MAX_ID of the trace "
                                  "format); use 0 for off")
        if s.params.max_new_tokens > LIMITS["MAX_CTX"]:
            raise InfertraceError(f"--max-new-tokens {s.params.max_new_tokens} is over the limit of {LIMITS['MAX_CTX']} "
                                  "tokens per request (MAX_CTX of the trace format)")
        if s.arrival_step > LIMITS["MAX_STEPS"]:
            raise InfertraceError(f"--arrival {s.arrival_step} is over the limit of {LIMITS['MAX_STEPS']} steps (MAX_STEPS)")
    bound = run_step_bound(specs, ctx_size, context_shift)
    if bound > LIMITS["MAX_STEPS"]:
        why = "with --context-shift every request generates all its --max-new-tokens" if context_shift else \
            "each request generates up to min(--max-new-tokens, --ctx-size - 1) tokens"
        raise InfertraceError(f"the run could take up to {bound} steps ({why}), more than the {LIMITS['MAX_STEPS']} a trace "
                              "holds (MAX_STEPS); lower --max-new-tokens")
    if context_shift:  # bounded by -n alone: at least the smallest trace it can write must fit the read cap
        from infertrace.engine.trace_budget import check_context_shift_budget

        check_context_shift_budget([s.params.max_new_tokens for s in specs], [s.arrival_step for s in specs])


def print_run_cost(progress: Any, loaded: Any, specs: list[PromptSpec], opts: EngineOptions, dtype: str) -> None:
    """Print one ``warning:`` line on stderr per :func:`infertrace.kv.budget.run_cost_warnings` message
    (a context or generation length past the model's trained context, with its KV cache and step cost)."""
    from infertrace.kv.budget import check_kv_budget, run_cost_warnings
    from infertrace.runner import parse_dtype

    check_kv_budget(loaded.config, opts, parse_dtype(dtype), loaded.model.device)  # a refusal is the only line
    news = [s.params.max_new_tokens for s in specs]
    for w in run_cost_warnings(loaded.config, opts, news, parse_dtype(dtype), default_ctx_size=EngineOptions.ctx_size):
        progress.console.print(f"warning: {w}", markup=False, highlight=False, soft_wrap=True)


def apply_spec_options(opts: EngineOptions, speculative: Optional[str], num_spec_tokens: int, spec_tree: Optional[str],
                       draft_model: Optional[str], draft_layers: Optional[int], ngram_min: int, ngram_max: int) -> EngineOptions:
    """Check the speculative-decoding options (before a model loads) and return ``opts`` with them set.

    Raises:
        InfertraceError: an unknown method, a malformed ``--spec-tree``; ConfigError: what
            :meth:`~infertrace.engine.config.SpeculativeConfig.validate` refuses (a draft option without a method ...).
    """
    import dataclasses

    method = check_choice("--speculative", speculative, ("ngram", "draft", "mtp")) if speculative is not None else None
    from infertrace.engine.speculative import parse_tree

    tree = parse_tree(spec_tree) if spec_tree is not None else None  # "" is a tree of 0 nodes: refused
    if tree is not None and num_spec_tokens != EngineOptions.num_spec_tokens:
        raise InfertraceError(f"--num-spec-tokens sets a chain's length; --spec-tree gives the tree itself ({len(tree)} "
                              "nodes): drop one of them")
    return dataclasses.replace(opts, speculative=method, num_spec_tokens=num_spec_tokens, spec_tree=tree,
                               draft_model=draft_model, draft_layers=draft_layers, ngram_min=ngram_min,
                               ngram_max=ngram_max).validate()  # ConfigError: the flag's value


def check_weights(weights: str) -> str:
    """``--weights`` lower-cased if it is ``auto``, ``float`` or ``quant`` (checked before any model loads).

    Raises:
        InfertraceError: another value (one line naming the choices).
    """
    from infertrace.loading.model import WEIGHTS

    return check_choice("--weights", weights, WEIGHTS)


def weights_record(loaded: Any) -> dict[str, Any]:
    """``{"weights": {...}}`` for a report or trace header when the quantised path computed (which kernel per
    tensor type, :attr:`infertrace.loading.model.Loaded.weights`), else ``{}`` (the float path, as before)."""
    w = getattr(loaded, "weights", None) or {}
    return {"weights": w} if w.get("weights") not in (None, "float") else {}


def default_ctx_note(loaded: Any, opts: EngineOptions, runtime: str) -> tuple[EngineOptions, Optional[str]]:
    """Without ``--ctx-size``: the default, lowered to the model's trained context (``n_ctx_train``, HF
    ``max_position_embeddings`` / GGUF ``context_length``) when that is smaller, for every runtime (vLLM refuses a
    ``max_model_len`` above its derived one).

    Returns:
        ``(opts, note)``: the options with the context size used and the trace note saying so (None when the
        default was kept).
    """
    import dataclasses

    n_train = int(loaded.config.n_ctx_train)
    if not 0 < n_train < opts.ctx_size:
        return opts, None
    note = (f"--ctx-size not given: {n_train} tokens, the model's trained context (max_position_embeddings / "
            f"context_length), instead of the default {opts.ctx_size}"
            + _runtime_ctx_note(runtime))
    return dataclasses.replace(opts, ctx_size=n_train), note


def _runtime_ctx_note(runtime: str) -> str:
    """The runtime's reason for the lowered default context (its registry entry's ``ctx_note``)."""
    from infertrace.runtimes.api import info

    return info(runtime).ctx_note
