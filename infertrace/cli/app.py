"""The ``infertrace`` Typer app: global options, command registration and error policy.

Error policy (fastapi-cli style, design.md): a user error (:class:`InfertraceError`) prints
one line ``error: <message>`` to stderr (control characters made visible,
:func:`infertrace.safe_text.visible`) and exits with its ``exit_code`` (2); anything
unexpected prints ``error: internal error: <Type>: <msg> (rerun with --debug ...)`` and exits 1.
``--debug`` prints the traceback first (same exit codes). Typer/click usage errors keep
their own message and exit code 2. A closed stdout (``infertrace show DIR | head``) ends the
command quietly with exit code 141, as a tool killed by SIGPIPE (no traceback, no message).

The policy lives in :func:`cli_errors`, which wraps every command, so it holds both for the
console script (:func:`main`) and for ``typer.testing.CliRunner`` invoking :data:`app`.
"""

import errno
import functools
import os
import sys
import traceback
from typing import Annotated, Any, Callable, TypeVar

import typer

from infertrace.cli import inspect_cmd, run
from infertrace.cli import diff_backends, dump_kv
from infertrace.cli import bisect_cmd, check_cmd, diff_cmd, report_cmd, show
from infertrace.cli import collect_cmd, export_cmd, make_qwen35
from infertrace.errors import ConfigError, InfertraceError, quiet_broken_pipe
from infertrace.safe_text import visible

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    name="infertrace",
    help="Trace the five inference variables (hidden, positions/RoPE, mask, KV cache, decode loop) of a "
         "decoder model (Llama, Mistral, Qwen2/3, Gemma 3, Qwen3.5) step by step, in llama.cpp and TensorRT-LLM/vLLM conventions.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


#: set by the global callback at every invocation (so CliRunner runs do not leak it into each other)
_STATE = {"debug": False}


def _is_cli_control(e: BaseException) -> bool:
    """Exit/Abort/usage errors of click or Typer (Typer >= 0.2x vendors its own click)."""
    return type(e).__module__.split(".")[0] in ("click", "typer")


#: OSError numbers that say "this path cannot name a file", not "the tool broke"
_PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR})


def report_error(exc: BaseException, debug: bool) -> int:
    """Print the one-line message for ``exc`` to stderr (after the traceback when ``debug``);
    return the exit code: ``exc.exit_code`` for :class:`InfertraceError`, 1 otherwise."""
    if debug:
        exc.__suppress_context__ = False  # show the low-level cause a user error was raised from
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if isinstance(exc, ConfigError):  # a config field, named by its flag
        from infertrace.cli.run_options import config_error_line

        typer.echo(f"error: {_one_line(visible(config_error_line(exc)))}", err=True)
        return exc.exit_code
    if isinstance(exc, InfertraceError):
        typer.echo(f"error: {_one_line(visible(exc.message))}", err=True)
        return exc.exit_code
    if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS and exc.filename is not None:
        # a path the user typed that no file system can hold (a name over NAME_MAX, a file used as a
        # folder, a symlink loop): wherever a command first touches it (Path.exists / is_dir raise these)
        name = visible(os.fsdecode(exc.filename))
        name = name if len(name) <= 120 else name[:60] + "..." + name[-40:]
        typer.echo(f"error: {name}: {exc.strerror}; give a valid path", err=True)
        return 2
    hint = "" if debug else " (rerun with --debug for the traceback)"
    typer.echo(f"error: internal error: {type(exc).__name__}: {_one_line(visible(str(exc)))}{hint}", err=True)
    return 1


def cli_errors(fn: F) -> F:
    """Wrap a command: InfertraceError / unexpected exceptions -> one line + ``typer.Exit(code)``.

    Click's own control-flow exceptions (Exit, Abort, usage errors) pass through unchanged.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:  # stdout closed by its reader (| head): quiet, exit 141
            quiet_broken_pipe()
        except Exception as e:  # noqa: BLE001 - the CLI's single error boundary
            if _is_cli_control(e):
                raise
            raise typer.Exit(report_error(e, _STATE["debug"])) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def _global(
    debug: Annotated[bool, typer.Option("--debug", envvar="INFERTRACE_DEBUG",
                                        help="Show the Python traceback of an error (before the one-line message).")] = False,
) -> None:
    """Trace the five inference variables of a decoder model, step by step, in both runtime conventions."""
    _STATE["debug"] = debug


app.command("run", help=run.HELP)(cli_errors(run.run))
app.command("inspect", help=inspect_cmd.HELP)(cli_errors(inspect_cmd.inspect))
app.command("dump-kv", help=dump_kv.HELP, no_args_is_help=True)(cli_errors(dump_kv.dump_kv))
app.command("diff-backends", help=diff_backends.HELP, no_args_is_help=True)(cli_errors(diff_backends.diff_backends))
app.command("diff-runtimes", help=diff_backends.RUNTIMES_HELP, no_args_is_help=True)(cli_errors(diff_backends.diff_runtimes))
app.command("show", help=show.HELP, no_args_is_help=True)(cli_errors(show.show))
app.command("diff", help=diff_cmd.HELP, no_args_is_help=True)(cli_errors(diff_cmd.diff))
app.command("report", help=report_cmd.HELP, no_args_is_help=True)(cli_errors(report_cmd.report))
app.command("bisect", help=bisect_cmd.HELP, no_args_is_help=True)(cli_errors(bisect_cmd.bisect))
app.command("export", help=export_cmd.HELP, no_args_is_help=True)(cli_errors(export_cmd.export))
app.command("check", help=check_cmd.HELP, no_args_is_help=True)(cli_errors(check_cmd.check))
app.command("make-qwen35", help=make_qwen35.HELP, no_args_is_help=True)(cli_errors(make_qwen35.make_qwen35))
app.command("collect", help=collect_cmd.HELP, no_args_is_help=True)(cli_errors(collect_cmd.collect))


def main() -> None:
    """Console-script entry point (``infertrace``): runs :data:`app` and exits with its code."""
    try:
        rv = app(prog_name="infertrace", standalone_mode=False)
    except BrokenPipeError:
        quiet_broken_pipe()
    except Exception as e:  # noqa: BLE001 - errors raised outside a command (e.g. while parsing)
        if _is_cli_control(e):
            sys.exit(_cli_control_exit(e))
        sys.exit(report_error(e, _STATE["debug"]))
    sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


def _command_in_argv() -> str | None:
    """The subcommand named on the command line (click leaves a missing option value without a context)."""
    names = {c.name for c in app.registered_commands}
    return next((a for a in sys.argv[1:] if a in names), None)


def _cli_control_exit(e: BaseException) -> int:
    """Print click's / Typer's own control exceptions the way every other error is printed and return the
    exit code: a usage error (unknown option, bad value, missing argument) as one ``error:`` line naming
    the command's help (exit 2), a bare command (``no_args_is_help``: Typer has printed its help) exit 2, Ctrl-C as
    ``Aborted.`` (exit 1), an explicit exit with its code."""
    name = type(e).__name__
    if name == "NoArgsIsHelpError":  # a bare `infertrace show`: Typer printed the help already
        return 2
    if hasattr(e, "format_message") and hasattr(e, "exit_code") and name != "Exit":  # UsageError and its kinds
        ctx = getattr(e, "ctx", None)
        cmd = ctx.info_name if ctx is not None and ctx.parent is not None else _command_in_argv()
        where = f"infertrace {cmd} -h" if cmd else "infertrace -h"
        typer.echo(f"error: {_one_line(visible(e.format_message())).rstrip('.')}; see '{where}'", err=True)
        return int(e.exit_code)
    if name == "Abort":
        typer.echo("Aborted.", err=True)
        return 1
    return int(getattr(e, "exit_code", 1) or 0)


if __name__ == "__main__":  # pragma: no cover
    main()
