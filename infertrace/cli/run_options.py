"""The ``run`` options other commands repeat (``dump-kv``, ``diff-backends``): one Annotated alias
per option, and :func:`build_run_inputs`, which validates them exactly as ``run`` does and
returns the prompt specs and engine options. Typer needs each option in the command's own
signature, so commands list the aliases; the help texts and checks live here once.
"""

from pathlib import Path
from typing import Annotated, Optional

import typer

from infertrace.cli.run import ATTENTION, BACKENDS, DEVICES, check_choice, check_min, read_prompts_file
from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.runner import PromptSpec, parse_dtype

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
Seed = Annotated[int, typer.Option("--seed", help="Seed of each request's sampler.")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Keep generating after an end-of-generation token.")]
Backend = Annotated[str, typer.Option("--backend", help="KV cache / attention convention: cells (llama.cpp) or paged (TensorRT-LLM/vLLM).")]
CtxSize = Annotated[int, typer.Option("--ctx-size", help="KV capacity and per-request context limit, in tokens.")]
NumBlocks = Annotated[Optional[int], typer.Option("--num-blocks", help="paged: blocks in the pool (default ctx-size / tokens-per-block).")]
TokensPerBlock = Annotated[int, typer.Option("--tokens-per-block", help="paged: slots per block.")]
MaxBatchTokens = Annotated[int, typer.Option("--max-batch-tokens", help="Scheduler token budget per step.")]
PrefillChunk = Annotated[Optional[int], typer.Option("--prefill-chunk", help="Max prompt tokens per request per step (chunked prefill).")]
Attention = Annotated[str, typer.Option("--attention", help="Attention implementation: torch, triton (paged only) or auto.")]
Dtype = Annotated[str, typer.Option("--dtype", help="Compute dtype: float32, bfloat16 or float16.")]
Device = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (nothing else).")]

D = SamplingParams  # defaults
E = EngineOptions


def build_run_inputs(*, prompt: Optional[list[str]], prompts: Optional[Path], arrival: Optional[list[int]],
                     max_new_tokens: int, chat: bool, temperature: float, top_k: int, top_p: float, min_p: float,
                     repetition_penalty: float, seed: int, ignore_eos: bool, backend: str, ctx_size: int,
                     num_blocks: Optional[int], tokens_per_block: int, max_batch_tokens: int,
                     prefill_chunk: Optional[int], attention: str, dtype: str, device: str
                     ) -> tuple[list[PromptSpec], EngineOptions]:
    """Validate ``run``'s options (before any model loads) and build the requests and engine options.

    Returns:
        ``(specs, opts)``: one :class:`PromptSpec` per ``--prompt`` (then per ``--prompts`` line),
        and the :class:`EngineOptions`.

    Raises:
        InfertraceError: any invalid option, with the option's name in the one-line message.
    """
    backend = check_choice("--backend", backend, BACKENDS)
    attention = check_choice("--attention", attention, ATTENTION)
    device = check_choice("--device", device, DEVICES)
    parse_dtype(dtype)
    if attention == "triton":  # fail before the model loads, with the engine's own messages
        import torch

        from infertrace.attention.select import resolve_attention

        if backend == "cells":
            raise InfertraceError("--attention triton needs --backend paged (the Triton kernel reads the paged pool)")
        resolve_attention("triton", torch.device(device if device == "cpu" else "cuda"))
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InfertraceError("--device cuda requested but CUDA is not available; use --device cpu")
    for opt, val, lo in (("--ctx-size", ctx_size, 1), ("--num-blocks", num_blocks, 1),
                         ("--tokens-per-block", tokens_per_block, 1), ("--max-batch-tokens", max_batch_tokens, 1),
                         ("--prefill-chunk", prefill_chunk, 1), ("--seed", seed, 0)):
        check_min(opt, val, lo)
    defaults = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "min_p": min_p, "repetition_penalty": repetition_penalty, "seed": seed, "ignore_eos": ignore_eos}
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
    opts = EngineOptions(backend=backend, ctx_size=ctx_size, num_blocks=num_blocks, tokens_per_block=tokens_per_block,
                         max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk, attention=attention)
    return specs, opts
