"""tool_choice "auto": the tool-call format found in a chat template, and calls parsed out of text."""

from __future__ import annotations

import json

import jinja2
import pytest

from autoglm_trt.serve.tool_parsers import ToolFormat, detect

SYSTEM = ("{% if tools %}<|system|>\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
          "Answer with <tool_call>...</tool_call> or name\\n{json}.{% endif %}")
TURN = "{% for m in messages %}<|{{ m.role }}|>\n{% if m.tool_calls %}{% for tc in m.tool_calls %}CALL{% endfor %}" \
       "{% else %}{{ m.content }}{% endif %}{% endfor %}"
CALLS = {
    "glm4": "{{ tc.function.name }}\n{{ tc.function.arguments }}",
    "glm45": "<tool_call>{{ tc.function.name }}\n{% for k, v in (tc.function.arguments | fromjson).items() %}"
             "<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>\n{% endfor %}</tool_call>",
    "hermes": '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}\n</tool_call>',
    None: "{{ tc.function.name }}({{ tc.function.arguments }})",  # a call in no format this parses
}


class Templated:
    """What ``detect`` needs of a tokenizer: its template, rendered."""

    def __init__(self, template: str):
        env = jinja2.Environment()
        env.filters["fromjson"] = json.loads
        self.chat_template, self.template = template, env.from_string(template)

    def render_chat(self, messages, add_generation_prompt=True, tools=None) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools)


@pytest.mark.parametrize("kind", list(CALLS))
def test_detect_reads_the_format_from_an_assistant_turn_with_a_call(kind):
    """The system prompt that mentions both tag styles does not mislead it: only the turn counts."""
    found = detect(Templated(SYSTEM + TURN.replace("CALL", CALLS[kind])))
    assert (found.name if found else None) == kind


def test_no_template_or_one_without_calls_has_no_format():
    assert detect(None) is None
    assert detect(Templated("{% for m in messages %}{{ m.content }}{% endfor %}")) is None


NAMES = ["tap", "back"]


def test_glm4_calls_and_text():
    f = ToolFormat("glm4")
    [[content, [call]]] = [f.parse('tap\n{"x": 5, "y": 7}\n', NAMES)]
    assert content is None and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "tap", "arguments": '{"x": 5, "y": 7}'}
    assert f.parse('swipe\n{"x": 5}', NAMES) is None  # not a tool
    assert f.parse("tap\n[1, 2]", NAMES) is None and f.parse("The weather is fine.", NAMES) is None
    assert f.parse('tap\n{"x": 5', NAMES) is None  # cut short
    assert [f.could_start(t, NAMES) for t in ("", "ta", "tap", "tap\n", 'tap\n{"x', "The", "tap now", "tap\nok")] == \
        [True, True, True, True, True, False, False, False]


def test_glm45_calls_values_as_json_or_text():
    f = ToolFormat("glm45")
    text = "Let me tap.<tool_call>tap\n<arg_key>x</arg_key>\n<arg_value>5</arg_value>\n" \
           "<arg_key>label</arg_key>\n<arg_value>OK button</arg_value>\n</tool_call>"
    content, [call] = f.parse(text, NAMES)
    assert content == "Let me tap." and json.loads(call["function"]["arguments"]) == {"x": 5, "label": "OK button"}
    assert f.parse("<tool_call>swipe\n</tool_call>", NAMES) is None
    assert [f.could_start(t, NAMES) for t in ("<tool", "<tool_call>tap", "Sure")] == [True, True, False]


def test_hermes_several_calls():
    f = ToolFormat("hermes")
    text = '<tool_call>\n{"name": "tap", "arguments": {"x": 1, "y": 2}}\n</tool_call>\n' \
           '<tool_call>{"name": "back", "arguments": {}}</tool_call>'
    content, calls = f.parse(text, NAMES)
    assert content is None and [c["function"]["name"] for c in calls] == ["tap", "back"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1, "y": 2}
    assert calls[0]["id"] != calls[1]["id"]
    assert f.parse('<tool_call>{"name": "tap"}</tool_call>', NAMES) is None  # no arguments


def test_output_nested_deeper_than_json_reads_is_text_not_an_error():
    """A model (or a guided call) can write JSON nested deeper than Python's json reads; that raised
    RecursionError through the parsers, a 500."""
    from autoglm_trt.serve.protocol import tool_calls

    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000
    assert ToolFormat("glm4").parse(f"tap\n{deep}", ["tap"]) is None
    assert ToolFormat("hermes").parse(f'<tool_call>{{"name": "tap", "arguments": {deep}}}</tool_call>', ["tap"]) is None
    assert ToolFormat("glm45").parse(f"<tool_call>tap\n<arg_key>x</arg_key><arg_value>{deep}</arg_value></tool_call>",
                                     ["tap"])[1][0]["function"]["name"] == "tap"  # the value kept as text
    assert tool_calls(deep, "tap") is None and tool_calls("[" * 100_000, "*") is None


@pytest.mark.parametrize("kind, text", [
    ("glm4", 'f\n{"a": "\\ud800", "b": "é"}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "\\ud800", "b": "é"}}</tool_call>'),
    ("glm45", '<tool_call>f\n<arg_key>a</arg_key><arg_value>"\\ud800"</arg_value>'
              '<arg_key>b</arg_key><arg_value>"é"</arg_value></tool_call>')])
def test_a_lone_surrogate_in_parsed_arguments_stays_escaped(kind, text):
    """JSON's escape can make a lone surrogate, which UTF-8 cannot carry: such arguments go out
    escaped to ASCII (the same value to a client's JSON parser), so the response can be written."""
    _, calls = ToolFormat(kind).parse(text, ["f"])
    arguments = calls[0]["function"]["arguments"]
    arguments.encode("utf-8")
    assert json.loads(arguments) == {"a": "\ud800", "b": "é"}
    _, plain = ToolFormat(kind).parse(text.replace("\\ud800", "x"), ["f"])
    assert plain[0]["function"]["arguments"] == '{"a": "x", "b": "é"}'  # without one, non-ASCII as it is

