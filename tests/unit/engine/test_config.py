"""The typed engine configs (engine/config.py): each validate() rule with a failing value and its exact
words, the flat recorded form unchanged, and the CLI's field -> flag table in both directions."""

from __future__ import annotations

import ast
from dataclasses import asdict, fields
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.engine.config import (MAX_DRAFT, CacheConfig, ConfigError, SchedulerConfig, ServingConfig,
                                      SpeculativeConfig)
from infertrace.engine.options import EngineOptions, SamplingParams

ROOT = Path(__file__).resolve().parents[3]

CASES = [  # (options, field, reason)
    (dict(backend="pages"), "cache.backend", "must be one of cells, paged, dense (got 'pages')"),
    (dict(ctx_size=0), "cache.ctx_size", "must be >= 1 (got 0)"),
    (dict(ctx_size=(1 << 24) + 1), "cache.ctx_size", "16777217 is over the limit of 16777216 tokens"),
    (dict(tokens_per_block=0), "cache.tokens_per_block", "must be >= 1 (got 0)"),
    (dict(tokens_per_block=65537), "cache.tokens_per_block", "65537 is over the limit of 65536 slots per block"),
    (dict(num_blocks=0), "cache.num_blocks", "must be >= 1 (got 0)"),
    (dict(num_blocks=1 << 20, tokens_per_block=32), "cache.num_blocks",
     "1048576 blocks of 32 tokens are over the limit of 16777216 tokens"),
    (dict(n_seq_max=0), "cache.n_seq_max", "must be >= 1 (got 0)"),
    (dict(kv_dtype="f8"), "cache.kv_dtype", "must be one of f32, f16, bf16 (got 'f8')"),
    (dict(kv_unified=False, backend="paged"), "cache.kv_unified",
     "off (one stream per sequence) is llama.cpp's cells convention; it needs backend cells"),
    (dict(kv_unified=False, ctx_size=3, n_seq_max=4), "cache.ctx_size",
     "3 cells leave no cell per stream for 4 streams (kv_unified off: one per sequence); raise it"),
    (dict(max_batch_tokens=0), "scheduler.max_batch_tokens", "must be >= 1 (got 0)"),
    (dict(prefill_chunk=0), "scheduler.prefill_chunk", "must be >= 1 (got 0)"),
    (dict(prefill_chunk=(1 << 24) + 1), "scheduler.prefill_chunk", "16777217 is over the limit of 16777216 tokens"),
    (dict(speculative="eagle"), "speculative.method", "must be one of ngram, draft, mtp (got 'eagle')"),
    (dict(num_spec_tokens=4), "speculative.num_spec_tokens",
     "sets speculative decoding, which is off; choose a method (ngram, draft, mtp)"),
    (dict(speculative="ngram", num_spec_tokens=65), "speculative.num_spec_tokens", "65 is over the limit of 64 drafts"),
    (dict(speculative="ngram", spec_tree=(-1, 1)), "speculative.spec_tree",
     "node 1 has parent 1: a parent must be -1 (the last token) or an earlier node"),
    (dict(speculative="ngram", spec_tree=()), "speculative.spec_tree", "must have 1..64 nodes (got 0)"),
    (dict(speculative="ngram", ngram_min=3, ngram_max=2), "speculative.ngram_min",
     "ngram_min and ngram_max must satisfy 1 <= min <= max <= 16 (got 3, 2)"),
    (dict(speculative="mtp", ngram_max=5), "speculative.ngram_min",
     "ngram_min / ngram_max set the n-gram drafter; they need method ngram"),
    (dict(speculative="ngram", draft_layers=1), "speculative.draft_layers", "names a draft model; it needs method draft"),
    (dict(speculative="draft"), "speculative.method",
     "draft needs exactly one of draft_model (a path) or draft_layers (k)"),
    (dict(speculative="draft", draft_layers=0), "speculative.draft_layers", "must be >= 1 (got 0)"),
    (dict(n_keep=-2, context_shift=True), "serving.n_keep", "must be >= -1 (got -2)"),
    (dict(n_discard=2), "serving.n_discard", "sets how a context shift works; it needs context_shift on"),
    (dict(context_shift=True, ctx_size=16, n_keep=13), "serving.n_keep",
     "13 leaves nothing to shift in a context of 16 tokens (a shift keeps at most n_ctx - 4 = 12, BOS included, "
     "as llama.cpp's server)"),
    (dict(context_shift=True, ctx_size=16, n_keep=2, n_discard=13), "serving.n_discard",
     "13 is more than a context shift of 16 tokens can drop (at most ctx_size - 2 - n_keep = 12)"),
    (dict(attention="flash"), "attention", "must be one of torch, triton, auto (got 'flash')"),
    (dict(sampler_order="vllm"), "sampler_order", "must be one of hf, llama.cpp (got 'vllm')"),
    (dict(attention="triton"), "attention", "triton reads the paged pool; it needs backend paged"),
    (dict(kv_unified=False, n_seq_max=2, prefix_cache=True), "serving.prefix_cache",
     "needs kv_unified on: across streams llama.cpp's seq_cp copies whole streams, which the cells prefix reuse "
     "does not do"),
    (dict(kv_unified=False, n_seq_max=2, speculative="ngram"), "speculative.method",
     "is not implemented with kv_unified off"),
    (dict(backend="paged", attention="triton", speculative="ngram", spec_tree=(-1, -1)), "speculative.spec_tree",
     "with branches needs the torch attention (the Triton kernel reads causal lengths only)"),
]


@pytest.mark.parametrize("kw,field,reason", CASES, ids=[c[1] + ":" + ",".join(c[0]) for c in CASES])
def test_each_rule_refuses_with_its_field_and_words(kw, field, reason):
    with pytest.raises(ConfigError) as e:
        EngineOptions(**kw).validate()
    assert (e.value.field, e.value.reason) == (field, reason)
    assert str(e.value) == f"{field}: {reason}" and "--" not in reason  # the library's words, no CLI flag
    assert e.value.exit_code == 2


def test_edges_that_pass():
    EngineOptions().validate()
    EngineOptions(ctx_size=1 << 24, tokens_per_block=1 << 16, num_blocks=256, max_batch_tokens=1,
                  prefill_chunk=1, n_seq_max=1).validate()
    EngineOptions(speculative="ngram", num_spec_tokens=MAX_DRAFT, ngram_min=16, ngram_max=16).validate()
    EngineOptions(speculative="ngram", spec_tree=tuple(range(-1, MAX_DRAFT - 1))).validate()
    EngineOptions(backend="paged", attention="triton", speculative="ngram", spec_tree=(-1, 0)).validate()  # a chain
    EngineOptions(context_shift=True, ctx_size=16, n_keep=12, n_discard=2).validate()
    EngineOptions(context_shift=True, n_keep=-1).validate()
    EngineOptions(kv_unified=False, ctx_size=4, n_seq_max=4).validate()


def test_views_carry_every_flat_field_once_and_the_record_is_flat():
    o = EngineOptions(backend="paged", ctx_size=100, num_blocks=7, tokens_per_block=16, n_seq_max=3, kv_dtype="f16",
                      max_batch_tokens=99, prefill_chunk=5, speculative="draft", draft_layers=2, prefix_cache=False,
                      n_keep=0, audit_kv=False)
    assert o.cache == CacheConfig("paged", 100, 7, 16, 3, True, "f16")
    assert o.scheduler == SchedulerConfig(99, 5)
    assert o.speculative_config == SpeculativeConfig("draft", 3, None, None, 2, 1, 3)
    assert o.serving == ServingConfig(False, False, 0, 0, False)
    names = {f.name for f in fields(EngineOptions)}
    mapped = {"speculative" if f.name == "method" else f.name
              for c in (CacheConfig, SchedulerConfig, SpeculativeConfig, ServingConfig) for f in fields(c)}
    assert names - mapped == {"attention", "sampler_order"}  # the two engine-level choices
    assert list(asdict(o)) == [f.name for f in fields(EngineOptions)]  # options["settings"] stays the flat record


def _raised_fields() -> set[str]:
    """Every literal field a ConfigError is raised with (or _at_least is given) in the package."""
    out = set()
    for p in (ROOT / "infertrace").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("ConfigError", "_at_least"):
                arg = node.args[0]
                if isinstance(arg, ast.JoinedStr):  # f"speculative.{name}": any field of that config
                    prefix = arg.values[0].value
                    config = {"speculative.": SpeculativeConfig, "sampling.": SamplingParams}[prefix]
                    out |= {prefix + f.name for f in fields(config)}
                    continue
                for c in ast.walk(arg):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        out.add(c.value)
    return out


def test_flag_table_covers_every_raised_field_and_names_real_run_flags():
    import click
    import typer

    from infertrace.cli.app import app
    from infertrace.cli.run_options import CONFIG_FLAGS

    raised = _raised_fields()
    assert "cache.tokens_per_block" in raised and "speculative.spec_tree" in raised  # the walk finds them
    assert raised <= set(CONFIG_FLAGS), raised - set(CONFIG_FLAGS)
    cmd = typer.main.get_command(app)
    run = cmd.get_command(click.Context(cmd), "run")
    flags = {o for p in run.params for o in p.opts}
    assert set(CONFIG_FLAGS.values()) <= flags, set(CONFIG_FLAGS.values()) - flags


@pytest.mark.parametrize("args,line", [
    (["--tokens-per-block", "0"], "error: --tokens-per-block: must be >= 1 (got 0)"),
    (["--backend", "paged", "--num-blocks", "0"], "error: --num-blocks: must be >= 1 (got 0)"),
    (["--max-batch-tokens", "0"], "error: --max-batch-tokens: must be >= 1 (got 0)"),
    (["--n-discard", "3"], "error: --n-discard: sets how a context shift works; it needs context_shift on"),
    (["--speculative", "ngram", "--num-spec-tokens", "65"], "error: --num-spec-tokens: 65 is over the limit of 64 drafts"),
    (["--speculative", "ngram", "--spec-tree=-1,1"],
     "error: --spec-tree: node 1 has parent 1: a parent must be -1 (the last token) or an earlier node"),
    (["--kv-unified", "off", "--ctx-size", "1", "-p", "b"],
     "error: --ctx-size: 1 cells leave no cell per stream for 2 streams (kv_unified off: one per sequence); raise it"),
])
def test_cli_names_the_flag_in_one_line(args, line, tmp_path):
    """Refused before any model loads (the model file does not exist), exit 2, one line."""
    from infertrace.cli.app import app

    r = CliRunner().invoke(app, ["run", "-m", str(tmp_path / "missing.gguf"), "-p", "a", *args])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == line


def test_python_m_infertrace_prints_the_flag_and_exits_2(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "infertrace", "run", "-m", str(tmp_path / "missing.gguf"), "-p", "a",
                        "--tokens-per-block", "70000"], capture_output=True, text=True, env=env, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", "error: --tokens-per-block: 70000 is over the limit of 65536 "
                                                        "slots per block\n")


def test_speculation_beside_a_serving_mechanism_is_our_engines_limit_not_the_options():
    """vLLM runs n-gram drafts with its prefix cache: the options stay valid, infertrace's own engine refuses."""
    from infertrace.engine.config import ConfigError
    from infertrace.engine.options import EngineOptions

    opts = EngineOptions(speculative="ngram", prefix_cache=True).validate()
    from infertrace.engine.speculative import Speculator

    class _E:  # the attributes Speculator reads before refusing
        pass

    e = _E()
    e.opts = opts
    with pytest.raises(ConfigError) as err:
        Speculator(e)
    assert err.value.field == "speculative.method" and "cannot be combined with prefix_cache" in str(err.value)
