"""Chat templates render under limits: time, loop iterations, call depth, string and output size.

A chat template is code from the model file. jinja2's ``ImmutableSandboxedEnvironment`` already
stops it from reaching Python internals (and caps ``range()`` at 100,000 items), but not from
nesting loops (``range(100000)`` inside ``range(100000)``), recursing through macros, doubling a
string until memory runs out, or asking for ``"x" | center(10**10)``. :class:`LimitedSandbox`
closes those:

- every ``{% for %}`` iterates through :meth:`LimitedSandbox.bounded_iter` (the template's AST is
  rewritten before compilation, through ``EnvironmentAttribute`` nodes a template cannot shadow),
  which checks the deadline and the total iteration count;
- every call (macros, methods, globals, ``loop()`` of recursive loops) goes through the sandbox's
  :meth:`call` hook, which checks the deadline, the call depth and the size arguments;
- ``*``, ``**``, ``+``, ``%`` are intercepted to bound the result before it is computed; ``~``
  concatenations and filter results are bounded after; filters get the same argument checks;
- the output is streamed and cut at ``MAX_TEMPLATE_OUTPUT_CHARS``.

Every limit hit raises :class:`TemplateLimitError` (a jinja2 ``TemplateError``) naming the limit; any
other exception a hostile template provokes (``ZeroDivisionError``, ``TypeError`` ...) becomes a
``TemplateRuntimeError``, so the caller turns both into one ``error:`` line.
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any, Callable, Iterable, Iterator

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

#: wall-clock seconds one render may take (real chat templates take milliseconds).
MAX_TEMPLATE_SECONDS = 5.0
#: loop iterations over one render, all loops together.
MAX_TEMPLATE_ITERATIONS = 1_000_000
#: nested calls (macro recursion, recursive loops).
MAX_TEMPLATE_CALL_DEPTH = 64
#: characters of the rendered text, and of any string / list the template builds.
MAX_TEMPLATE_OUTPUT_CHARS = 8 << 20
#: exponent of ``**`` between integers.
MAX_TEMPLATE_EXPONENT = 4096

_WIDTH_RE = re.compile(r"\d{8,}")  # a format width / precision of >= 10^7 in %-format or str.format


class TemplateLimitError(jinja2.exceptions.TemplateRuntimeError):
    """A chat template exceeded a render limit (the message names it)."""


class _Bounder(NodeTransformer):
    """Rewrites ``for x in E`` into ``for x in environment.bounded_iter(E)`` and ``a ~ b`` into
    ``environment.bounded_value(a ~ b)``."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("bounded_value"), [node], [], None, None, lineno=node.lineno)


def _size(v: Any) -> int:
    return len(v) if isinstance(v, (str, bytes, list, tuple)) else 0


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with render limits (see the module docstring).

    Call :meth:`render` (not ``Template.render``) so the per-render budget is reset and the
    output is streamed under the size limit.
    """

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, seconds: float = MAX_TEMPLATE_SECONDS, iterations: int = MAX_TEMPLATE_ITERATIONS,
                 depth: int = MAX_TEMPLATE_CALL_DEPTH, output_chars: int = MAX_TEMPLATE_OUTPUT_CHARS, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_seconds, self.max_iterations, self.max_depth, self.max_chars = seconds, iterations, depth, output_chars
        self._deadline = time.monotonic() + seconds
        self._iterations = 0
        self._depth = 0
        self.filters = _WrappedFilters(self, self.filters)

    # -- budget ------------------------------------------------------------------------------
    def begin(self) -> None:
        """Reset the per-render budget (deadline, iteration count, depth)."""
        self._deadline = time.monotonic() + self.max_seconds
        self._iterations = 0
        self._depth = 0

    def tick(self) -> None:
        """Raise :class:`TemplateLimitError` once the render's deadline has passed."""
        if time.monotonic() > self._deadline:
            raise TemplateLimitError(f"rendering took longer than the limit of {self.max_seconds:g} s")

    def check_args(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Refuse size arguments (widths, counts) over the output limit, and ``replace`` / ``join``
        calls whose result would exceed it, before the call allocates anything."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise TemplateLimitError(f"argument {a} is over the template size limit of {self.max_chars} characters")
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if name in ("replace", "do_replace"):  # str.replace("", new) inserts `new` between every character
            strs = [owner, *args[:2]] if isinstance(owner, str) else [a for a in args if isinstance(a, str)][:3]
            if len(strs) == 3 and strs[1] == "" and (len(strs[0]) + 1) * len(strs[2]) > self.max_chars:
                raise TemplateLimitError(f"replace() would build a string over the limit of {self.max_chars} characters")
        if name in ("format", "do_format") and any(isinstance(a, str) and _WIDTH_RE.search(a) for a in args):
            raise TemplateLimitError("a %-format width or precision is over the template size limit")
        if name in ("join", "do_join"):
            seq = args[0] if isinstance(owner, str) and args else next((a for a in args if isinstance(a, (list, tuple))), None)
            if isinstance(seq, (list, tuple)):
                total = sum(_size(x) for x in seq) + len(seq) * _size(owner)
                if total > self.max_chars:
                    raise TemplateLimitError(f"join() would build a string over the limit of {self.max_chars} characters")

    def bounded_value(self, v: Any) -> Any:
        """Return ``v`` unless it is a string or sequence longer than the limit."""
        if _size(v) > self.max_chars:
            raise TemplateLimitError(f"the template built a value of {_size(v)} items, over the limit of {self.max_chars}")
        return v

    def bounded_iter(self, iterable: Any) -> Iterator[Any]:
        """Iterate ``iterable`` checking the deadline and the render's total iteration count."""
        for x in iterable:
            self._iterations += 1
            if self._iterations > self.max_iterations:
                raise TemplateLimitError(f"loops ran more than the limit of {self.max_iterations} iterations")
            if not self._iterations & 255:
                self.tick()
            yield x

    # -- sandbox hooks -----------------------------------------------------------------------
    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's signature
        __self.tick()
        __self.check_args(__obj, args, kwargs)
        if __self._depth >= __self.max_depth:
            raise TemplateLimitError(f"calls nest deeper than the limit of {__self.max_depth} (recursive macro?)")
        __self._depth += 1
        try:
            return __self.bounded_value(super().call(__context, __obj, *args, **kwargs))
        finally:
            __self._depth -= 1

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int) and _size(seq) * n > self.max_chars:
                    raise TemplateLimitError(f"'*' would build a value of {_size(seq) * n} items, over the limit of {self.max_chars}")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > MAX_TEMPLATE_EXPONENT:
                raise TemplateLimitError(f"exponent {right} is over the template limit of {MAX_TEMPLATE_EXPONENT}")
        elif operator == "+":
            if _size(left) + _size(right) > self.max_chars:
                raise TemplateLimitError(f"'+' would build a value over the limit of {self.max_chars} items")
        elif operator == "%" and isinstance(left, str) and _WIDTH_RE.search(left):
            raise TemplateLimitError("a %-format width or precision is over the template size limit")
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        f_self = getattr(value, "__self__", None)
        if isinstance(f_self, str) and getattr(value, "__name__", "") in ("format", "format_map") and _WIDTH_RE.search(f_self):
            raise TemplateLimitError("a format width or precision is over the template size limit")
        return super().wrap_str_format(value)

    def _generate(self, source: nodes.Template, name: Any, filename: Any, defer_init: bool = False) -> str:
        return super()._generate(_Bounder().visit(source), name, filename, defer_init=defer_init)

    # -- render --------------------------------------------------------------------------------
    def render(self, template: jinja2.Template, **context: Any) -> str:
        """Render ``template`` (compiled by this environment) under the limits.

        Raises:
            TemplateLimitError: a limit was hit (the message names it).
            jinja2.exceptions.TemplateError: the template's own errors; any other exception the
                template provokes is re-raised as ``TemplateRuntimeError`` with its type and message.
        """
        self.begin()
        out: list[str] = []
        n = 0
        try:
            for chunk in template.generate(**context):
                n += len(chunk)
                if n > self.max_chars:
                    raise TemplateLimitError(f"the rendered prompt is over the limit of {self.max_chars} characters")
                out.append(chunk)
                self.tick()
        except jinja2.exceptions.TemplateError:
            raise
        except RecursionError:
            raise TemplateLimitError("the template recursed deeper than Python allows") from None
        except MemoryError:
            raise TemplateLimitError("the template ran out of memory") from None
        except Exception as e:  # noqa: BLE001 - a hostile template can raise anything Python can
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            raise jinja2.exceptions.TemplateRuntimeError(f"{type(e).__name__}: {msg}") from None
        return "".join(out)


class _WrappedFilters(dict):
    """``env.filters`` whose entries check their arguments and bound their result (filters are
    called directly by compiled templates, not through the sandbox's ``call`` hook)."""

    def __init__(self, env: LimitedSandbox, base: dict):
        super().__init__()
        self._env = env
        for k, v in base.items():
            self[k] = v

    def __setitem__(self, key: str, func: Any) -> None:
        super().__setitem__(key, _wrap_filter(self._env, func))


def _wrap_filter(env: LimitedSandbox, func: Any) -> Any:
    if getattr(func, "_infertrace_bounded", False):
        return func

    @functools.wraps(func)  # keeps jinja's pass_context / pass_eval_context / pass_environment marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        env.tick()
        env.check_args(func, args, kwargs)
        return env.bounded_value(func(*args, **kwargs))

    wrapper._infertrace_bounded = True  # type: ignore[attr-defined]
    return wrapper
