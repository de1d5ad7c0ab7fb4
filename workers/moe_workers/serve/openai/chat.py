"""Chat prompts: the checkpoint's own chat template, rendered in a sandbox (pure; no HTTP here).

The template comes from the checkpoint as Hugging Face keeps it: `chat_template.jinja`, or the
`chat_template` field of `tokenizer_config.json` (a string, or a list of named templates of
which "default" is used). It is rendered the way transformers' `apply_chat_template` does:
`messages`, `add_generation_prompt`, the special tokens of tokenizer_config.json, and
`raise_exception` for templates that refuse a conversation, in Jinja2's immutable sandbox (a
template cannot reach Python objects, files or the network).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from moe_workers.serve.openai.protocol import ChatMessage, RequestError

MAX_RENDERED_CHARS = 4 * 1024 * 1024  # a template that loops cannot grow the prompt without bound


class TemplateError(Exception):
    """The template itself is broken (raised at load, so the replica says so at start)."""


def _special(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str | None]):
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # as transformers renders them (templates test `if tools` and the like on undefined names)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson  # Jinja's own escapes HTML characters; transformers' does not
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as err:
            raise TemplateError(f"the chat template does not parse: {err}") from None
        self.template_source, self.special = source, special

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> "ChatTemplate | None":
        directory = Path(directory)
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        special = {k: _special(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text(), special)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        return cls(source, special) if isinstance(source, str) and source else None

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt; `tools` as OpenAI sends them ({"type": "function", "function": {...}}), which
        transformers' apply_chat_template passes to the template as they are. An assistant
        message's tool calls go in with their arguments as an object where they are JSON (as
        templates expect them, and as vLLM passes them)."""
        def conversation(parsed: bool) -> list[dict]:
            return [{"role": m.role, "content": m.text() if m.content is not None or not m.tool_calls else None,
                     **({"name": m.name} if m.name else {}),
                     **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {}),
                     **({"tool_calls": [_call(c, parsed) for c in m.tool_calls]} if m.tool_calls else {})}
                    for m in messages]

        extra = {"tools": tools} if tools else {}
        special = {k: v for k, v in self.special.items() if v is not None}
        try:
            try:
                text = self.template.render(messages=conversation(True), add_generation_prompt=add_generation_prompt,
                                            **extra, **special)
            except _Refused:
                raise
            except Exception:
                if not any(m.tool_calls for m in messages):
                    raise
                # a template that joins arguments as text (DeepSeek-V3's does) gets them as sent
                text = self.template.render(messages=conversation(False), add_generation_prompt=add_generation_prompt,
                                            **extra, **special)
        except _Refused as err:
            raise RequestError(400, f"messages: the chat template refuses this conversation: {err}",
                               param="messages") from None
        except Exception as err:  # whatever a template raises is about this conversation, not the server
            raise RequestError(400, f"messages: the chat template cannot render this conversation: "
                               f"{type(err).__name__}: {err}", param="messages") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise RequestError(400, f"messages: the rendered prompt has {len(text)} characters, more than "
                               f"{MAX_RENDERED_CHARS}", param="messages")
        return text


class _Refused(Exception):
    pass


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _call(call, parsed: bool = True) -> dict:
    arguments = call.function.arguments
    if parsed:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _raise(message: str):
    raise _Refused(message)


# The template `moectl init-model` writes (tokenizer_config.json), so the quickstart can chat and
# call tools: tools, calls and results as Mistral's published templates write them (the
# convention serve/openai/tools.py reads for the mixtral family), spelled out in text.
SIMPLE_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}[TOOL_RESULTS] {{ {'call_id': m['tool_call_id'], 'content': m['content']} | tojson }}"
    "[/TOOL_RESULTS]\n"
    "{% elif m['tool_calls'] %}<|assistant|>\n[TOOL_CALLS] {{ m['tool_calls'] | map(attribute='function') | list "
    "| tojson }}{{ eos_token }}\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer_config(directory: str | Path, template: str = SIMPLE_TEMPLATE) -> Path:
    path = Path(directory) / "tokenizer_config.json"
    path.write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                "chat_template": template}, indent=2))
    return path
