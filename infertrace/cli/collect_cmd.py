"""``infertrace collect SPOOL --model GGUF --save DIR [--request ID]``: a served vLLM's spool (written by the
vLLM plugin, :mod:`infertrace.runtimes.vllm.plugin`) joined into an ordinary ``runtime: vllm`` trace of the
marked requests, which ``show``, ``check``, ``report``, ``dump-kv``, ``diff`` and ``run --backend paged
--replay`` read (:mod:`infertrace.runtimes.vllm.collect`). The spool is untrusted: bounded, validated,
a bad one is one line and exit 2.
"""

from pathlib import Path
from typing import Annotated, Optional

import typer

HELP = ("Join a served vLLM's spool (INFERTRACE_SPOOL, written by infertrace's vLLM plugin) by engine step and rank into "
        "a trace of the marked requests (\"vllm_xargs\": {\"infertrace\": LABEL} in the request body), for show, check, "
        "report, dump-kv, diff and run --backend paged --replay.")


def collect(
    spool: Annotated[Path, typer.Argument(help="The spool directory the server wrote (INFERTRACE_SPOOL).", show_default=False)],
    save: Annotated[Path, typer.Option("--save", help="Write the trace to this directory.", show_default=False)],
    model: Annotated[Optional[Path], typer.Option("--model", "-m", help="The GGUF the server's model was converted from "
                                                  "(default: infertrace's default model).")] = None,
    request: Annotated[Optional[str], typer.Option("--request", help="One marked request: vLLM's request id, the response "
                                                   "id (cmpl-...) or the client's label (default: all marked).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing trace in --save.")] = False,
) -> None:
    from infertrace.cli.run import check_output_dir, save_run
    from infertrace.loading.registry import default_model_path
    from infertrace.runner import load_model
    from infertrace.runtimes.vllm.collect import collect_trace
    from infertrace.runtimes.vllm.spool_read import read_spool

    check_output_dir(save, force)
    sp = read_spool(str(spool))  # validated before the model loads
    loaded = load_model(model if model is not None else default_model_path())
    tensors: dict = {}
    trace = collect_trace(sp, loaded, request, tensors)
    save_run(trace, save, tensors, [trace.options["layer"]], force)
    n = sum(1 for s in trace.steps if s.batch)
    typer.echo(f"collected {len(trace.requests)} marked request(s) over {len(trace.steps)} steps ({n} with marked rows) "
               f"into {save}")
