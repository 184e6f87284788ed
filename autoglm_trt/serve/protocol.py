"""The OpenAI wire format this server speaks: request models, responses, stream chunks, errors.

Requests are pydantic models: every field is checked by type and range, and every field a
request carries is honoured or refused with a 400 that names it (``REFUSED`` says why for the
OpenAI and vLLM fields the server does not do; any other unknown field is refused too), never
silently dropped. ``n`` samples share the prompt's KV blocks; the extension ``beam_width`` (with
``length_penalty``) is the engine's beam search, whose ``n`` best beams are the choices.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import AutoGLMError
from ..runtime.guided import Guide
from ..runtime.request import TokenLogprob
from ..runtime.sampling import MAX_LOGPROBS, MAX_SEQUENCES, MAX_STOP_STRINGS, MIN_REPETITION_PENALTY, SamplingParams
from .guard import body_problem
from .tool_parsers import call


class _Strict(BaseModel):
    """A request object whose unknown fields are refused (a 400 naming them), never dropped."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


# Fields the server does not do, with the reason its 400 gives (every other unknown field is refused too)
REFUSED = {
    "echo": "echo is not supported by this server",
    "best_of": "best_of is not supported by this server; use n for several samples",
    "suffix": "suffix (insertion) is not supported by this server",
    "functions": "functions (function calling) are not supported by this server",
    "function_call": "function_call is not supported by this server (no functions)",
    "logit_bias_type": "logit_bias_type is not supported by this server",
    "skip_special_tokens": "skip_special_tokens: the server always skips special tokens in text",
    "include_stop_str_in_output": "include_stop_str_in_output: stop strings are never included in the text",
}
# what a neutral value of a refused field is: sent by some clients with every request
NEUTRAL: dict[str, tuple] = {"echo": (False,), "functions": (None, []), "function_call": (None, "none"),
           "best_of": (None, 1),
           "suffix": (None, ""), "skip_special_tokens": (True,), "include_stop_str_in_output": (False,)}


class _Sampling(_Strict):
    """The sampling fields of both endpoints. Every field a request carries is honoured or refused
    with a 400 that names it (``REFUSED``, or unknown); none is dropped."""

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        problem = body_problem(data)
        if problem is not None:
            raise ValueError(problem)
        return data

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_SEQUENCES)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    user: str | None = None  # an end-user id: accepted, as OpenAI's; it changes nothing here
    # extensions (vLLM's names, and the engine's beam search)
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=1 / MIN_REPETITION_PENALTY)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    beam_width: int = Field(default=1, ge=1, le=MAX_SEQUENCES)
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=-(2**31), le=2**31)  # lower runs first
    # structured output: OpenAI's response_format, and vLLM's guided_* / structured_outputs (one at most)
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # a Lark grammar, or the name of a shipped one ("autoglm_action")
    structured_outputs: dict | None = None  # {"json" | "regex" | "choice" | "grammar": ...}

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        """A refused field's 400 says why; its neutral value (some clients send one always) passes."""
        if isinstance(data, dict):
            for key, why in REFUSED.items():
                if key in data and data[key] not in NEUTRAL.get(key, ()):
                    raise ValueError(why)
            data = {k: v for k, v in data.items() if k not in REFUSED}
        return data

    @model_validator(mode="after")
    def _one_guide(self) -> _Sampling:
        self.guide()  # a malformed or doubled guide is this request's 400
        return self

    def guide(self) -> Guide | None:
        """The output's guide from whichever field names one (ValueError for several, or a malformed one)."""
        found = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                found.append(Guide.json_object())
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
                found.append(Guide.json_schema(spec["schema"]))
            elif kind != "text":
                raise ValueError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}')
        named = dict(self.structured_outputs or {})
        for key, value in (("json", self.guided_json), ("regex", self.guided_regex), ("choice", self.guided_choice),
                           ("grammar", self.guided_grammar)):
            if value is not None:
                named.setdefault(key, value)
        unknown = set(named) - {"json", "regex", "choice", "grammar"}
        if unknown:
            raise ValueError(f"structured_outputs takes json, regex, choice or grammar, not {sorted(unknown)}")
        for key, value in named.items():
            if key == "json":
                found.append(Guide.json_schema(value))
            elif key == "regex":
                found.append(Guide.regex(value))
            elif key == "choice":
                if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                    raise ValueError("a choice guide is a list of strings")
                found.append(Guide.choice(value))
            elif isinstance(value, str) and value.replace("_", "").isalnum():
                try:
                    found.append(Guide.shipped(value))
                except AutoGLMError as exc:
                    raise ValueError(str(exc)) from exc
            else:
                found.append(Guide.lark(value))
        if len(found) > 1:
            raise ValueError("give one output guide: response_format, guided_json, guided_regex, guided_choice or "
                             "guided_grammar")
        return found[0] if found else None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):  # "²" and "١٢" are digits to str.isdigit
                raise ValueError(f"logit_bias keys are token ids (strings of the digits 0-9), got {key[:20]!r}")
        return v

    def sampling(self, max_tokens: int, timeout: float | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, stop=tuple(stop), ignore_eos=self.ignore_eos,
                              timeout=timeout, priority=self.priority, n=self.n, beam_width=self.beam_width,
                              length_penalty=self.length_penalty, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                              min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
                              logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                              logprobs=self.top_logprob_count, guide=self.guide())

    @property
    def top_logprob_count(self) -> int | None:
        """``SamplingParams.logprobs``: how many alternatives each token reports (None: no logprobs)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # the legacy API's: top alternatives

    @property
    def top_logprob_count(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # a data: URL (or file:// under the server's --allowed-local-media-path)
    # "auto" and "high" are what the server does: the model's processor resizes within max_pixels
    detail: Literal["auto", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    name: str | None = None  # passed to the chat template
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls, passed to the chat template
    tool_call_id: str | None = None  # a tool turn's answer to that call

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (only an assistant turn with tool_calls may leave it out)")
        return self

    def as_engine_message(self) -> dict:
        """The message as the engine takes it: text joined into a string, or with images its parts."""
        out: dict = {"role": "system" if self.role == "developer" else self.role}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.content is None:
            return {**out, "content": None}
        if isinstance(self.content, str) or all(isinstance(p, TextPart) for p in self.content):
            text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)  # type: ignore[union-attr]
            return {**out, "content": text}
        return {**out, "content": [p.model_dump(exclude_none=True) for p in self.content]}


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None  # the arguments always follow the schema here


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # a call is one tool call here; true allows that, false asks it

    def carries_images(self) -> bool:
        return any(isinstance(p, ImagePart) for m in self.messages if isinstance(m.content, list) for p in m.content)

    def called_tool(self) -> str | None:
        """The function a named ``tool_choice`` calls, "*" when one is required, None when none is."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return "*" if choice == "required" else None

    def tool_schema(self) -> dict | None:
        """The JSON schema the call is generated under: the named function's arguments, or (required)
        one of ``{"name": <a tool>, "arguments": <its arguments>}``."""
        called = self.called_tool()
        if called is None:
            return None
        params = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools or []}
        if called != "*":
            return params.get(called)  # (a name not among the tools is _tools' 400)
        return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                           "properties": {"name": {"const": name}, "arguments": schema}}
                          for name, schema in params.items()]}

    def guide(self) -> Guide | None:
        found = super().guide()
        schema = self.tool_schema()
        if schema is not None and found is not None:
            raise ValueError("a required or named tool call is its own output guide; give no other")
        return Guide.json_schema(schema) if schema is not None else found

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools {names}")
        return self

    def auto_tools(self) -> list[str]:
        """The tools' names when the model decides whether to call one (``tool_choice`` "auto", the
        default with tools), else []."""
        return [t.function.name for t in self.tools or []] if self.tool_choice in (None, "auto") else []

    def template_tools(self) -> list[dict] | None:
        """The tool definitions as the chat template reads them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param, self.headers = (
            status, message, type_, code, param, headers)


OPENAI_FINISH = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


Decode = Callable[[int], str]  # one token id -> its text


def chat_logprobs(entries: list[TokenLogprob] | None, decode: Decode) -> dict | None:
    """OpenAI chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if entries is None:
        return None

    def item(token: int, logprob: float) -> dict:
        text = decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob] | None, decode: Decode, offset: int = 0) -> dict | None:
    """The completions API's ``logprobs``: parallel lists of tokens, their log-probabilities, the top
    alternatives by token text, and each token's offset in the text (from ``offset``)."""
    if entries is None:
        return None
    tokens = [decode(e.token) for e in entries]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))[:len(tokens)]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode(t): v for t, v in e.top} for e in entries], "text_offset": offsets}


def completion_response(rid: str, model: str, choices: list[tuple[str, str, dict | None]], use: dict) -> dict:
    """``choices``: (text, finish reason, logprobs) of each sample or beam, in order."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": k, "text": text, "finish_reason": OPENAI_FINISH.get(finish, finish),
                         "logprobs": lp} for k, (text, finish, lp) in enumerate(choices)], "usage": use}


def chat_response(rid: str, model: str, choices: list[tuple[str, str, dict | None]], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": k, "message": {"role": "assistant", "content": text},
                         "finish_reason": OPENAI_FINISH.get(finish, finish), "logprobs": lp}
                        for k, (text, finish, lp) in enumerate(choices)], "usage": use}


def tool_calls(text: str, called: str) -> list[dict] | None:
    """OpenAI's ``tool_calls`` from a guided call's text (``called``: the named function, or "*" for
    ``{"name", "arguments"}``); None when the text is not a whole call (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's json reads
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = (called, value) if called != "*" else (value.get("name"), value.get("arguments"))
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return [call(name, arguments)]


def completion_chunk(rid: str, model: str, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": None if finish is None else OPENAI_FINISH.get(finish, finish)}]}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                         "finish_reason": None if finish is None else OPENAI_FINISH.get(finish, finish)}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}
