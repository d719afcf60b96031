"""The environment chat templates render in, as transformers' `apply_chat_template` builds it: a sandbox
(ImmutableSandboxedEnvironment) with trim_blocks, lstrip_blocks and loop controls, the `{% generation %}` tag, a
`tojson` filter without HTML escaping (ensure_ascii=False), `raise_exception`, `strftime_now`, `dict`, and a
`namespace` that refuses underscore names. Inputs reach a template as plain JSON-like values only (`plain`).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (raise_exception) or failed to render it."""


def plain(value: Any) -> Any:
    """Deep copy of JSON-like data, so the template sees only plain dict/list/str/number/bool/None values."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    for base in (str, int, float):  # subclasses (str/int enums, ...) back to the base type
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    raise ChatTemplateError(f"chat template inputs must be JSON-like; got a {type(value).__name__}")


class _Namespace(jinja2.utils.Namespace):
    """jinja2 namespace that refuses underscore-prefixed attributes (no reaching into CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers) and renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _DictFactory:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A chat template compiled once (ChatTemplateError on a syntax error); `render` turns the template's own
    failures (raise_exception, a missing key, a wrong type) into ChatTemplateError."""

    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.globals["namespace"] = _Namespace
        env.globals["dict"] = _DictFactory()
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e

    def render(self, **variables: Any) -> str:
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e
        except (TypeError, AttributeError, KeyError) as e:
            raise ChatTemplateError(f"chat template could not render this conversation: {e}") from e
