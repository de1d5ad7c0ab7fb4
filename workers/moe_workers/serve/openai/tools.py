"""Tool calls in each family's published convention: where they start in a completion, how to read
them back into OpenAI's `tool_calls`, and the grammar that forces them (`tool_choice` "required"
or a named function). Pure: no engine, no HTTP.

Conventions (as the published chat templates render them, and the models write them):
- hermes (Qwen3, Qwen2-MoE): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block a call;
- mistral (Mixtral): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`;
- deepseek (DeepSeek-V3, -V2): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
- harmony (gpt-oss): a `commentary` message addressed to the function,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the
  recipient may stand in the role header instead: `<|start|>assistant to=functions.NAME`).
Markers that are single tokens of the vocabulary are matched as tokens; others as text (the
tests' byte-level vocabularies spell them out).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

FAMILY_FORMATS = {"qwen3_moe": "hermes", "qwen2_moe": "hermes", "mixtral": "mistral", "deepseek_v3": "deepseek",
                  "deepseek_v2": "deepseek", "gpt_oss": "harmony"}
DS = {"calls_begin": "<｜tool▁calls▁begin｜>", "calls_end": "<｜tool▁calls▁end｜>",
      "call_begin": "<｜tool▁call▁begin｜>", "call_end": "<｜tool▁call▁end｜>", "sep": "<｜tool▁sep｜>"}
START = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "deepseek": DS["calls_begin"], "harmony": None}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_DEEPSEEK = re.compile(re.escape(DS["call_begin"]) + r"\s*function\s*" + re.escape(DS["sep"]) +
                       r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n```\s*" + re.escape(DS["call_end"]), re.S)
_HARMONY = re.compile(r"(?:<\|start\|>([^<]*))?<\|channel\|>([^<]*?)(?:<\|constrain\|>\w+)?<\|message\|>(.*?)"
                      r"(?:<\|call\|>|<\|end\|>|<\|return\|>|$)", re.S)
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def tool_format(family: str | None) -> str:
    """The convention a family's published template uses (hermes where none is published)."""
    return FAMILY_FORMATS.get(family or "", "hermes")


def start_marker(fmt: str) -> str | None:
    """The text that opens a completion's tool calls (None: harmony, where a message header does)."""
    return START[fmt]


def parse(fmt: str, raw: str) -> tuple[str | None, list[ToolCall]]:
    """(the text before the calls, or None when there is none; the calls) of a completion's raw
    text, its special tokens kept. A call whose arguments are not JSON stays text."""
    if fmt == "harmony":
        calls = []
        for header, channel, body in _HARMONY.findall(raw):
            who = _RECIPIENT.search(f"{header} {channel}")
            if who and _is_json(body.strip()):
                calls.append(ToolCall(who.group(1), _compact(body.strip())))
        return None, calls
    start = raw.find(START[fmt])
    if start < 0:
        return raw, []
    before, rest = raw[:start], raw[start:]
    calls: list[ToolCall] = []
    if fmt == "hermes":
        for block in _HERMES.findall(rest):
            obj = _load(block)
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls.append(ToolCall(obj["name"], _arguments(obj.get("arguments", obj.get("parameters", {})))))
    elif fmt == "mistral":
        obj = _first_value(rest[len(START[fmt]):].strip())  # the list; an end token may follow
        for item in obj if isinstance(obj, list) else [obj] if isinstance(obj, dict) else []:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                calls.append(ToolCall(item["name"], _arguments(item.get("arguments", {})), str(item.get("id") or "")))
    else:  # deepseek
        for name, args in _DEEPSEEK.findall(rest):
            if _is_json(args):
                calls.append(ToolCall(name.strip(), _compact(args)))
    if not calls:
        return raw, []
    return (before if before.strip() else None), calls


_CUT_OBJECT = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>")?'
                         r'(?:\s*,\s*"arguments"\s*:\s*(?P<args>.*))?', re.S)


def cut_calls(fmt: str, raw: str, name: str | None = None) -> list[ToolCall]:
    """The calls of a completion that max_tokens cut while a forced call was being written (the
    grammar held it to the convention): the whole calls, then the one it was writing with its
    arguments as generated so far ("" if they had not begun: not JSON, as vLLM returns them).
    `name`: the function tool_choice names; None (tool_choice "required"): read from the text,
    and a call cut before its name is whole is dropped."""
    whole: list[ToolCall] = []
    tail: str | None = None  # the text of the call being written
    if fmt in ("hermes", "deepseek", "harmony"):
        opener = {"hermes": "<tool_call>", "deepseek": DS["call_begin"], "harmony": "<|channel|>"}[fmt]
        closer = {"hermes": "</tool_call>", "deepseek": DS["call_end"], "harmony": "<|call|>"}[fmt]
        end = raw.rfind(closer)
        whole = parse(fmt, raw[:end + len(closer)])[1] if end >= 0 else []
        at = raw.rfind(opener)
        tail = raw[at + len(opener):] if at > end else None
    elif fmt == "mistral":
        at = raw.find(START["mistral"])
        rest = raw[at + len(START["mistral"]):].lstrip().removeprefix("[") if at >= 0 else ""
        decoder = json.JSONDecoder()
        while at >= 0:
            rest = rest.lstrip().removeprefix(",")
            try:
                item, used = decoder.raw_decode(rest.lstrip())
            except ValueError:
                tail = rest
                break
            rest = rest.lstrip()[used:]
            if not rest.strip() or rest.lstrip().startswith("]"):
                at = -1  # the list ends here, or the next item has not begun
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                whole.append(ToolCall(item["name"], _arguments(item.get("arguments", {}))))
    if tail is None or not tail.strip():
        return whole or ([ToolCall(name, "")] if name else [])  # cut before the call's first marker was whole
    called, arguments = None, ""
    if fmt in ("hermes", "mistral"):
        m = _CUT_OBJECT.match(tail)
        if m and m.group("closed"):
            called, arguments = m.group("name"), m.group("args") or ""
    elif fmt == "deepseek":
        m = re.match(r"\s*function\s*" + re.escape(DS["sep"]) + r"\s*([^\n]+?)\s*\n(.*)$", tail, re.S)
        if m:
            fence, _, body = m.group(2).partition("\n")  # ```json, then the arguments
            called, arguments = m.group(1), body if fence.startswith("```") else ""
    else:  # harmony: commentary to=functions.NAME <|constrain|>json<|message|>{...
        m = _RECIPIENT.search(tail)
        if m and (m.end() < len(tail) and not tail[m.end()].isalnum() and tail[m.end()] not in "_.-"):
            called = m.group(1)
            arguments = tail.split("<|message|>", 1)[1] if "<|message|>" in tail else ""
    if called is None and name is None:
        return whole
    try:  # arguments already whole: without the end of the call's markers that may follow them
        arguments = arguments[:json.JSONDecoder().raw_decode(arguments)[1]]
    except ValueError:
        pass
    return whole + [ToolCall(name or called, arguments.rstrip())]


def _load(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _first_value(text: str):
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        return None


def _is_json(text: str) -> bool:
    return _load(text) is not None or text.strip() == "null"


def _compact(text: str) -> str:
    return json.dumps(json.loads(text), ensure_ascii=False)


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# --- forcing a call: the grammar of one (or, with parallel calls, several) of the given functions ---

def markers(fmt: str) -> list[str]:
    """The marker strings a convention's calls are written with."""
    return {"hermes": ["<tool_call>", "</tool_call>"], "mistral": ["[TOOL_CALLS]"], "deepseek": list(DS.values()),
            "harmony": ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"]}[fmt]


def call_grammar(fmt: str, functions: list[dict], parallel: bool, special: dict[str, int],
                 whitespace: str | None = None) -> str:
    """A Lark grammar (llguidance's dialect: %json{...} embeds a JSON schema) for the completion
    when a call is required: the family's markers around calls of `functions` ({"name",
    "parameters"}), whose arguments follow each function's parameters schema. `special`: markers
    that are single special tokens of the vocabulary (written as token references)."""

    def lit(text: str) -> str:
        return f"<[{special[text]}]>" if text in special else json.dumps(text)

    guidance = {"x-guidance": {"whitespace_pattern": whitespace}} if whitespace else {}

    def params(f: dict) -> str:
        return json.dumps({**(f.get("parameters") or {"type": "object"}), **guidance})

    names = [f["name"] for f in functions]
    if fmt == "hermes":
        objs = " | ".join(f"%json{json.dumps({**_call_schema(f), **guidance})}" for f in functions)
        call = f'{lit("<tool_call>")} "\\n" ({objs}) "\\n" {lit("</tool_call>")}'
        body = 'call ("\\n" call)*' if parallel else "call"
        return f"start: {body}\ncall: {call}\n"
    if fmt == "mistral":
        item = {"anyOf": [_call_schema(f) for f in functions]}
        array = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1}), **guidance}
        return f'start: {lit("[TOOL_CALLS]")} " "? %json{json.dumps(array)}\n'
    if fmt == "deepseek":
        alts = " | ".join(f'{lit(DS["call_begin"])} "function" {lit(DS["sep"])} {json.dumps(n)} "\\n```json\\n" '
                          f'%json{params(f)} "\\n```" {lit(DS["call_end"])}' for n, f in zip(names, functions))
        calls = "call+" if parallel else "call"
        return f'start: {lit(DS["calls_begin"])} {calls} {lit(DS["calls_end"])}\ncall: {alts}\n'
    # harmony: one call a message; the reasoning that may come first is the model's, not forced
    alts = " | ".join(f'"commentary to=functions.{n} " {lit("<|constrain|>")} "json" {lit("<|message|>")} '
                      f'%json{params(f)} {lit("<|call|>")}' for n, f in zip(names, functions))
    return f'start: {lit("<|channel|>")} ({alts})\n'


def _call_schema(f: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": f["name"]},
                                             "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}
