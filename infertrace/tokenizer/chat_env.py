"""The jinja2 environment chat templates expect: HF transformers' (``utils/chat_template_utils.py``
``_cached_compile_jinja_template``), so templates written for HF render as HF renders them.

What HF adds to jinja2 and templates rely on (case T2):

* the ``{% generation %}...{% endgeneration %}`` tag (HF's ``AssistantTracker`` marks assistant
  turns for ``return_assistant_tokens_mask``); for rendering it outputs its body unchanged;
* ``loopcontrols`` (``{% break %}`` / ``{% continue %}``), ``trim_blocks`` and ``lstrip_blocks``;
* globals ``raise_exception``, ``strftime_now``, ``dict`` and a ``namespace`` that rejects
  underscore-prefixed names; a ``tojson`` filter that does not HTML-escape.

All inside jinja2's ``ImmutableSandboxedEnvironment`` (templates come from model files).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infertrace.tokenizer.template_limits import LimitedSandbox


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}body{% endgeneration %}`` -> ``body`` (HF ``AssistantTracker`` without tracking)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (HF ``TemplateNamespace``)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attribute {name!r}")


class _Dict:
    """``dict(...)`` for templates without exposing the ``dict`` type itself (HF ``TemplateDict``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def chat_environment() -> ImmutableSandboxedEnvironment:
    """A fresh sandboxed environment configured as HF's chat-template environment."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # the sandbox with render limits (time, loop iterations, call depth, sizes: tokenizer/template_limits.py)
    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env
