"""Tool calling on /v1/chat/completions, as OpenAI's API and vLLM's hermes parser shape it.

- The tools reach the model through its chat template when the template renders `tools`; otherwise (SmolLM2's,
  Gemma 3's templates do not) a system message lists them and asks for `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>`, the format SmolLM2 and Hermes-style models were tuned on. A past assistant call and a `tool`
  message are rendered the same way.
- `tool_choice` "required" or a named function: the output is constrained (router/grammar.py) to one call,
  `{"name": <one of the tools>, "arguments": <its parameters' schema>}`, so it always parses and validates.
- "auto" (the default with tools): the output is free; `<tool_call>` blocks in it become calls, the text before
  them the message's content. "none": the tools are not shown and the answer is text.
"""
import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from router.api.errors import APIError
from router.api.validation import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')  # a constrained call's text up to its arguments


def invalid(message: str, param: str = "tools") -> APIError:
    return APIError(422, message, "validation", param)


@dataclass
class Tools:
    """The request's tools and what its tool_choice makes of them."""
    functions: list[dict]  # each {"name", "description"?, "parameters"?}
    choice: str  # "auto", "required" or "named"
    name: Optional[str] = None  # the named function
    native: bool = False  # the chat template renders `tools` itself

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def grammar(self) -> Optional[Grammar]:
        """required / named: one call of one of the (or the named) function(s), as a JSON schema."""
        if not self.constrained:
            return None
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for f in self.functions if self.name in (None, f["name"])]
        return Grammar(type="json", value=calls[0] if len(calls) == 1 else {"anyOf": calls})

    def system_prompt(self) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in self.functions)
        return ("You are a function calling AI model. You may call one or more of the functions listed within "
                f"<tools></tools>.\n<tools>\n{listed}\n</tools>\nTo call a function, answer with "
                f'{OPEN}{{"name": <function name>, "arguments": <arguments as a JSON object>}}{CLOSE}; '
                "otherwise answer in text.")


def resolve(tools: Optional[list[Any]], tool_choice: Any, template: Optional[str]) -> Optional[Tools]:
    """The request's `tools` and `tool_choice` checked; None when no tool is in play (none given, or "none")."""
    if tool_choice is not None and not tools:
        raise invalid("`tool_choice` needs `tools`", "tool_choice")
    if not tools:
        return None
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f'`tools[{i}]` must be {{"type": "function", "function": {{"name": ..., '
                          '"parameters": ...}}')
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise invalid(f"`tools[{i}].function.name` must be 1-64 letters, digits, '_', '.' or '-'")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise invalid(f"`tools[{i}].function.parameters` must be a JSON schema object")
        functions.append({k: fn[k] for k in ("name", "description", "parameters") if k in fn})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid("`tools` names must be unique")
    native = bool(template) and "tools" in template
    if tool_choice in (None, "auto"):
        return Tools(functions, "auto", native=native)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return Tools(functions, "required", native=native)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise invalid('`tool_choice` must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', "tool_choice")
    if name not in names:
        raise invalid(f"`tool_choice` names {name!r}, which is not in `tools`", "tool_choice")
    return Tools(functions, "named", name, native)


def render_call(call: dict) -> str:
    """A past assistant call as the model writes one."""
    fn = call.get("function") or {}
    arguments = fn.get("arguments")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass
    return OPEN + json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False) + CLOSE


def native_call(call: dict) -> dict:
    """A past call as chat templates that render tools take it: arguments as an object, not a string."""
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass
    return {"type": "function", "function": fn, **({"id": call["id"]} if "id" in call else {})}


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse(text: str, tools: Tools) -> tuple[Optional[str], list[dict]]:
    """The answer's (content, tool calls). A constrained answer is one call; a free one may hold `<tool_call>`
    blocks, whose text before is the content (a block that does not parse, or names no tool, stays text)."""
    if tools.constrained:
        try:
            call = json.loads(text)
            return None, [new_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))]
        except (json.JSONDecodeError, KeyError, TypeError):  # cut short by max_tokens: the text as it is
            return text, []
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls, names = [], {f["name"] for f in tools.functions}
    for block in text[start:].split(OPEN)[1:]:
        body = block.split(CLOSE)[0].strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("name") not in names or not isinstance(args, dict):
            return text, []
        calls.append(new_call(call["name"], json.dumps(args, ensure_ascii=False)))
    return (text[:start].strip() or None), calls


@dataclass
class ToolStream:
    """A streamed answer's deltas when tools are in play: content as it comes, up to a `<tool_call>` (auto);
    a constrained call's name as soon as it is known, then its arguments piece by piece (the call's closing
    brace held back: it is the outer object's)."""
    tools: Tools
    text: str = ""
    sent: int = 0  # characters of `text` accounted for by deltas sent
    call: Optional[dict] = None  # the constrained call once its name is known
    calls: list[dict] = field(default_factory=list)

    def push(self, piece: str, finished: bool) -> list[dict]:
        """The deltas (OpenAI `delta` objects) this piece of text makes ready."""
        self.text += piece
        if self.tools.constrained:
            return self._constrained(finished)
        return self._auto(finished)

    def _constrained(self, finished: bool) -> list[dict]:
        out = []
        if self.call is None:
            head = HEAD.match(self.text)
            if head is None:
                return [{"content": self.text}] if finished and self.text else []
            self.call = new_call(json.loads(head.group(1)), "")
            self.sent = head.end()
            out.append({"tool_calls": [{"index": 0, **copy.deepcopy(self.call)}]})  # a copy: its arguments grow
        end = len(self.text) - 1 if finished and self.text.endswith("}") else len(self.text) - (not finished)
        if end > self.sent:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": self.text[self.sent:end]}}]})
            self.call["function"]["arguments"] += self.text[self.sent:end]
            self.sent = end
        return out

    def _auto(self, finished: bool) -> list[dict]:
        start = self.text.find(OPEN)
        if start < 0:  # hold back what could begin a tag
            end = len(self.text)
            if not finished:
                end -= max((k for k in range(1, len(OPEN)) if self.text.endswith(OPEN[:k])), default=0)
            delta, self.sent = self.text[self.sent:end], max(self.sent, end)
            return [{"content": delta}] if delta else []
        out = []
        if start > self.sent:
            out.append({"content": self.text[self.sent:start]})
            self.sent = start
        if finished:
            content, self.calls = parse(self.text, self.tools)
            if not self.calls:  # not a call after all: the rest as text
                return out + [{"content": self.text[self.sent:]}]
            out += [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(self.calls)]
        return out

    @property
    def called(self) -> bool:
        return self.call is not None or bool(self.calls)
