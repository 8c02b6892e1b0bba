"""--chat-template-content-format: how message content reaches the chat template.

- `string`: each message's content is one string (text parts joined with newlines).
- `openai`: each message's content is a list of OpenAI parts, `[{"type": "text", "text": ...}]` (a string content
  becomes one part), for templates that loop over the parts themselves.
- `auto` (vLLM's default): `openai` when the template loops over a message's content, else `string`. The check reads
  the template's syntax tree, as vLLM's does: a variable holds messages when it is `messages` or is set from one
  that does (a slice, a filter); a message is the target of a `for` over such a variable; the template wants parts
  when it has a `for` over a message's `content` (or over a variable named `content`).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Iterator, Optional

import jinja2
import jinja2.ext
from jinja2 import nodes

logger = logging.getLogger("voltllm")

CONTENT_FORMATS = ("auto", "string", "openai")


class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' `{% generation %}...{% endgeneration %}` (assistant-mask templates) as its body, so such
    templates can be inspected too."""
    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _refers_to(node: nodes.Node, names: set[str], key: Optional[str] = None) -> bool:
    """Whether the expression is one of `names` (or its `key` item, `x.key` / `x['key']`), seen through filters,
    tests and slices (`messages | reverse`, `messages[1:]`)."""
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _refers_to(node.node, names, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _refers_to(node.node, names, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _refers_to(node.node, names)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _refers_to(node.node, names)
    return False


def _list_names(root: nodes.Template) -> set[str]:
    """`messages` and every variable set from it, directly or through another such variable."""
    names = {"messages"}
    grew = True
    while grew:
        grew = False
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in names and _refers_to(assign.node, names):
                names.add(target.name)
                grew = True
    return names


def _loop_targets(root: nodes.Template, names: set[str], key: Optional[str] = None) -> Iterator[str]:
    for loop in root.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and _refers_to(loop.iter, names, key):
            yield loop.target.name


def loops_over_content(template: str) -> bool:
    """Whether the template iterates over a message's content (wants OpenAI parts). Raises jinja2's
    TemplateSyntaxError for a template that does not parse."""
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    root = env.parse(template)
    message_names = set(_loop_targets(root, _list_names(root)))
    if message_names and any(True for _ in _loop_targets(root, message_names, "content")):
        return True
    return any(True for _ in _loop_targets(root, {"content"}))


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """`openai` or `string` for a template (logged once per template, as vLLM does); a template that does not parse
    is `string` (applying it then reports the syntax error)."""
    try:
        found = "openai" if loops_over_content(template) else "string"
    except jinja2.TemplateSyntaxError:
        return "string"
    logger.info("chat template content format detected: '%s' (--chat-template-content-format overrides it)", found)
    return found


def resolve_content_format(given: str, tokenizer: Any, chat_template: Optional[str],
                           tools: Optional[list] = None) -> str:
    """The format to use: `given` unless it is `auto`, else what the template that will be applied asks for (the
    given template, else the tokenizer's; none at all: `string`, and applying it reports the missing template)."""
    if given != "auto":
        return given
    template = chat_template
    if template is None:
        try:
            template = tokenizer.get_chat_template(None, tools)
        except (AttributeError, ValueError, TypeError):
            template = getattr(tokenizer, "chat_template", None)
    return detect_content_format(template) if isinstance(template, str) else "string"
