"""``infertrace make-qwen35``: write a Qwen3.5-0.8B-shaped checkpoint with random weights.

Thin: parse, call :func:`infertrace.loading.synth.write_qwen35_08b`, print what was written and the
command that prints the study's appendix B tables from a run on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infertrace.safe_text import visible

HELP = ("Write an HF checkpoint (or, with --format gguf, a llama.cpp GGUF) with the Qwen3.5-0.8B configuration of the "
        "study's appendix (24 layers = 18 GDN + 6 full attention, hidden 1024, vocab 248320, bfloat16, one MTP block "
        "for --speculative mtp) and RANDOM weights: shapes, dtypes and memory are the real model's, the tokens are not. "
        "About 1.5 GB.")

#: the study's example: a prompt of 8 tokens (byte-level tokenizer: 8 bytes)
EXAMPLE_PROMPT = "Hi Qwen!"


def make_qwen35(
    out: Annotated[Path, typer.Option("--out", "-o", help="New directory (hf) or file (gguf) to write the checkpoint into.")],
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
    fmt: Annotated[str, typer.Option("--format", help="hf (config.json + model.safetensors + tokenizer) or gguf "
                                     "(one qwen35 GGUF as llama.cpp's converter writes it; MTP as blk.24.nextn.*).")] = "hf",
) -> None:
    """Write the checkpoint, then print how to run the study's example on it."""
    from infertrace.loading.synth import RANDOM_NOTE, write_qwen35_08b

    write_qwen35_08b(out, seed, fmt=fmt)
    size = Path(out).stat().st_size if fmt == "gguf" else sum(f.stat().st_size for f in Path(out).iterdir())
    typer.echo(f"wrote {visible(str(out))} ({size / 2**30:.2f} GiB): Qwen3.5-0.8B configuration, {RANDOM_NOTE}")
    typer.echo(f"appendix B tables: infertrace run --model {visible(str(out))} --prompt '{EXAMPLE_PROMPT}' "
               "--max-new-tokens 2 --backend paged --dtype bfloat16")
