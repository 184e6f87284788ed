"""tool_choice "auto" over the OpenAI client: a model whose chat template writes GLM-4's tool calls
(the function's name on a line, then its arguments as JSON) gets its own calls back as OpenAI
``tool_calls``, whole and streamed, and its plain answers as text. The tiny random model is made
to answer in one way or the other with a guided regex (an extension this server has)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import build_tiny_engine
from test_serve import client, server

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn, prometheus-client) is not installed")

# GLM-4's conventions for tools: described in the system turn; a call is the assistant's name line
# and arguments; a tool's answer comes back as an observation
GLM4_TOOLS_TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\nYou may call these functions:{% for t in tools %}\n"
    "{{ t.function.name }}{% endfor %}{% endif %}{% for m in messages %}"
    "{% if m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>{% if m.tool_calls %}{% for tc in m.tool_calls %}"
    "{{ tc.function.name }}\n{{ tc.function.arguments }}{% endfor %}{% else %}\n{{ m.content }}{% endif %}"
    "{% elif m.role == 'tool' %}<|observation|>\n{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TAP = {"type": "function", "function": {"name": "tap", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}}
BACK = {"type": "function", "function": {"name": "back", "parameters": {"type": "object", "properties": {}}}}
CALL = r'tap\n\{"x": [1-9][0-9]?, "y": [1-9][0-9]?\}'


@pytest.fixture(scope="module")
def tools_engine(tiny_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tools") / "ckpt"
    shutil.copytree(tiny_dir("llama"), ckpt)
    (ckpt / "chat_template.jinja").write_text(GLM4_TOOLS_TEMPLATE)
    return build_tiny_engine(lambda family: ckpt, tmp_path_factory.mktemp("tools-eng") / "tiny-tools",
                             max_input_len=160, max_seq_len=224, kv_num_blocks=128)


def test_auto_returns_the_models_own_calls_and_its_text(tools_engine):
    messages = [{"role": "user", "content": "Open the settings."}]
    with server(tools_engine) as (port, _):
        c = client(port)
        r = c.chat.completions.create(model="tiny-tools", messages=messages, tools=[TAP, BACK], max_tokens=40,
                                      extra_body={"guided_regex": CALL})
        [call] = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert call.function.name == "tap" and set(json.loads(call.function.arguments)) == {"x", "y"}

        calls, text = [], ""
        for chunk in c.chat.completions.create(model="tiny-tools", messages=messages, tools=[TAP, BACK],
                                               tool_choice="auto", max_tokens=40, stream=True,
                                               extra_body={"guided_regex": CALL}):
            if chunk.choices:
                calls += chunk.choices[0].delta.tool_calls or []
                text += chunk.choices[0].delta.content or ""
        assert text == "" and len(calls) == 1 and calls[0].function.name == "tap"

        r = c.chat.completions.create(model="tiny-tools", messages=messages, tools=[TAP, BACK], max_tokens=40,
                                      extra_body={"guided_regex": "taps are done"})
        assert r.choices[0].message.content == "taps are done" and not r.choices[0].message.tool_calls
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(
            model="tiny-tools", messages=messages, tools=[TAP, BACK], max_tokens=40, stream=True,
            extra_body={"guided_regex": "taps are done"}) if chunk.choices)
        assert streamed == "taps are done"  # held back while it could begin "tap\n{", then sent

        history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function", "function": {"name": "back", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
        r = c.chat.completions.create(model="tiny-tools", messages=history, tools=[TAP, BACK], max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
