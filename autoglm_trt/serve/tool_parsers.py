"""``tool_choice: "auto"``: the model's own tool-call format, found in its chat template, parsed
out of what it generates.

A model decides by itself whether to call a tool, in the format it was trained on, which its
chat template writes back for an assistant turn that made calls. ``detect`` renders such a turn
(a probe call) and recognizes three formats:

    glm4    the function's name on a line, then its arguments as JSON (GLM-4 / GLM-4-0414)
    glm45   <tool_call>name <arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call> (GLM-4.5)
    hermes  <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen2.5, SmolLM3)

A template that renders none of them (or no tool calls at all) has no format here: the server
then refuses "auto" with a 400 rather than return a call as plain text. ``parse`` takes a whole
answer apart into its text and OpenAI ``tool_calls`` (None when it holds no complete call);
``could_start`` says whether an answer so far may still begin a call, so that a stream holds its
text back until it knows.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass

PROBE_NAME, PROBE_ARG = "probe_fn_7q", "probe_arg_7q"
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call(name: str, arguments: dict) -> dict:
    """One OpenAI tool call. Its arguments are JSON text as a model writes it (non-ASCII as it is),
    but escaped to ASCII where they hold a lone surrogate (JSON's ``\\ud800`` escape can carry one
    into a parsed value, and UTF-8 cannot encode it: the response could not be written)."""
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def _object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's json reads
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class ToolFormat:
    name: str  # glm4, glm45 or hermes

    def could_start(self, text: str, names: list[str]) -> bool:
        t = text.lstrip()
        if self.name != "glm4":
            return t.startswith(OPEN) or OPEN.startswith(t)
        head, newline, rest = t.partition("\n")
        if not newline:
            return any(n.startswith(head) for n in names)
        return head.strip() in names and (not rest.strip() or rest.lstrip().startswith("{"))

    def parse(self, text: str, names: list[str]) -> tuple[str | None, list[dict]] | None:
        """(the answer's text outside the calls, or None; its calls), or None without a whole call."""
        if self.name == "glm4":
            head, _, rest = text.strip().partition("\n")
            arguments = _object(rest.strip())
            return (None, [call(head.strip(), arguments)]) if head.strip() in names and arguments is not None else None
        calls, spans = [], list(re.finditer(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), text, re.DOTALL))
        for m in spans:
            found = self._hermes(m[1]) if self.name == "hermes" else self._glm45(m[1])
            if found is None or found[0] not in names:
                return None
            calls.append(call(*found))
        if not calls:
            return None
        rest = re.sub(re.escape(OPEN) + r".*?" + re.escape(CLOSE), "", text, flags=re.DOTALL).strip()
        return rest or None, calls

    @staticmethod
    def _hermes(body: str) -> tuple[str, dict] | None:
        value = _object(body.strip())
        if value is None or not isinstance(value.get("name"), str) or not isinstance(value.get("arguments"), dict):
            return None
        return value["name"], value["arguments"]

    @staticmethod
    def _glm45(body: str) -> tuple[str, dict] | None:
        name, _, rest = body.strip().partition("\n")
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", rest, re.DOTALL)
        arguments = {}
        for key, raw in pairs:
            try:
                arguments[key.strip()] = json.loads(raw)
            except (ValueError, RecursionError):
                arguments[key.strip()] = raw  # a string value is written as it is
        return name.strip(), arguments


def detect(tokenizer) -> ToolFormat | None:
    """The tool-call format the tokenizer's chat template writes, or None (no template, or one that
    renders tool calls in none of the formats above)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    tool = {"type": "function", "function": {"name": PROBE_NAME, "description": "a probe", "parameters": {
        "type": "object", "properties": {PROBE_ARG: {"type": "integer"}}}}}
    for arguments in (json.dumps({PROBE_ARG: 1}), {PROBE_ARG: 1}):  # OpenAI's string, or the object some want
        turn = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_probe", "type": "function", "function": {"name": PROBE_NAME, "arguments": arguments}}]}
        question = [{"role": "user", "content": "q"}]
        try:
            before = tokenizer.render_chat(question, add_generation_prompt=False, tools=[tool])
            whole = tokenizer.render_chat([*question, turn], add_generation_prompt=False, tools=[tool])
        except Exception:  # noqa: BLE001 - a template that cannot render a call has no format here
            continue
        # the assistant turn alone, not the tools described in the system prompt
        text = whole[len(os.path.commonprefix([before, whole])):]
        if f"{OPEN}{PROBE_NAME}" in text.replace(" ", "") and f"<arg_key>{PROBE_ARG}</arg_key>" in text:
            return ToolFormat("glm45")
        if OPEN in text and f'"{PROBE_NAME}"' in text:
            return ToolFormat("hermes")
        if re.search(re.escape(PROBE_NAME) + r"\s*\n\s*\{", text):
            return ToolFormat("glm4")
    return None
