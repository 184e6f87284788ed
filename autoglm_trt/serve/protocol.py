"""The OpenAI wire format this server speaks: request models, responses, stream chunks, errors.

Requests are pydantic models (unknown fields are ignored, as OpenAI clients send many);
every field is checked by type and range, and anything the engine cannot do (``logprobs``,
``echo``, penalties, ``n > 1`` with ``stream``) is refused with a 400 that says so, rather than
ignored. ``n`` samples share the prompt's KV blocks; the extension ``beam_width`` (with
``length_penalty``) is the engine's beam search, whose ``n`` best beams are the choices.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..runtime.sampling import MAX_SEQUENCES, MAX_STOP_STRINGS, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_SEQUENCES)
    # extensions (vLLM's names, and the engine's beam search)
    top_k: int = Field(default=0, ge=0)
    beam_width: int = Field(default=1, ge=1, le=MAX_SEQUENCES)
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=-(2**31), le=2**31)  # lower runs first
    # accepted only at their neutral values
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    logprobs: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported by this server")
        return v

    def sampling(self, max_tokens: int, timeout: float | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, stop=tuple(stop), ignore_eos=self.ignore_eos,
                              timeout=timeout, priority=self.priority, n=self.n, beam_width=self.beam_width,
                              length_penalty=self.length_penalty)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = Field(default=False, description="not supported")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this server")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str  # a data: URL (or file:// under the server's --allowed-local-media-path)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]

    def as_engine_message(self) -> dict:
        """The message as the engine takes it: text joined into a string, or with images its parts."""
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str) or all(isinstance(p, TextPart) for p in self.content):
            text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)  # type: ignore[union-attr]
            return {"role": role, "content": text}
        return {"role": role, "content": [p.model_dump(exclude_none=True) for p in self.content]}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


OPENAI_FINISH = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, choices: list[tuple[str, str]], use: dict) -> dict:
    """``choices``: (text, finish reason) of each sample or beam, in order."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": k, "text": text, "finish_reason": OPENAI_FINISH.get(finish, finish),
                         "logprobs": None} for k, (text, finish) in enumerate(choices)], "usage": use}


def chat_response(rid: str, model: str, choices: list[tuple[str, str]], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": k, "message": {"role": "assistant", "content": text},
                         "finish_reason": OPENAI_FINISH.get(finish, finish), "logprobs": None}
                        for k, (text, finish) in enumerate(choices)], "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": None if finish is None else OPENAI_FINISH.get(finish, finish)}]}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": None if finish is None else OPENAI_FINISH.get(finish, finish)}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}
