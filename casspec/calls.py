"""What an OpenAI API call may ask of casspec serve: the fields, their checks, and the Request it becomes.

A call goes through the same checks as `casspec generate` (Request, SamplingParams, Engine.prompt_ids: the same
messages). Fields casspec does not do get a 400 unless they hold the value that asks for nothing; unknown fields
get a 400 too: nothing is silently ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from starlette.responses import JSONResponse

from dsia.errors import CasspecError
from dytc.sampling import SamplingParams

from .engine import Engine
from .request import Request

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default for a call that names none (0 = greedy)
ROLES = ("system", "user", "assistant")  # chat roles handed to the chat template (no tool messages)


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "code", "param"}}."""
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


NUMBER = (int, float)
FIELDS: dict[str, tuple[tuple[type, ...], str]] = {  # what a call may set: accepted JSON types, in words
    "model": ((str,), "a string"),
    "max_tokens": ((int,), "an integer"),
    "temperature": (NUMBER, "a number"),
    "top_p": (NUMBER, "a number"),
    "top_k": ((int,), "an integer"),  # not OpenAI's (vLLM's extra parameter)
    "seed": ((int,), "an integer"),
    "stop": ((str, list), "a string or a list of strings"),
    "stream": ((bool,), "true or false"),
    "stream_options": ((dict,), "an object"),
}
CHAT_FIELDS = {**FIELDS, "messages": ((list,), "a list of messages"),
               "max_completion_tokens": ((int,), "an integer")}
COMPLETION_FIELDS = {**FIELDS, "prompt": ((str, list), "a string")}
UNSUPPORTED: dict[str, tuple[tuple, str]] = {  # OpenAI fields casspec does not do: (the values that ask for
    # nothing, accepted), and what to do instead
    "n": ((1,), "one choice per call: leave n out and repeat the call (with other seeds) for more"),
    "best_of": ((1,), "one candidate per call: leave best_of out"),
    "logprobs": ((False,), "log probabilities are not returned: leave logprobs out"),
    "top_logprobs": ((0,), "log probabilities are not returned: leave top_logprobs out"),
    "echo": ((False,), "the prompt is not echoed: leave echo out"),
    "suffix": (("",), "insertion (a suffix) is not supported: leave suffix out"),
    "presence_penalty": ((0, 0.0), "penalties are not supported: leave presence_penalty out"),
    "frequency_penalty": ((0, 0.0), "penalties are not supported: leave frequency_penalty out"),
    "logit_bias": (({},), "logit biases are not supported: leave logit_bias out"),
    "tools": (([],), "tool calls are not supported: leave tools out"),
    "tool_choice": (("none",), "tool calls are not supported: leave tool_choice out"),
    "functions": (([],), "function calls are not supported: leave functions out"),
    "function_call": (("none",), "function calls are not supported: leave function_call out"),
    "response_format": (({"type": "text"},), "structured output is not supported: leave response_format out"),
}


@dataclass(frozen=True)
class Call:
    """One checked API call, ready for the engine."""
    prompt_ids: list[int]
    request: Request
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def parse_call(body: Any, chat: bool, engine: Engine, template: Request, model_name: str) -> Call:
    """Check a call's JSON body and build its Request; ApiError (400, 404) for anything wrong or unsupported."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_request")
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key, value in body.items():
        if value is None:  # null: not given
            continue
        if key in UNSUPPORTED:
            neutral, instead = UNSUPPORTED[key]
            if not any(type(value) is type(n) and value == n for n in neutral):
                raise ApiError(400, f"{key}={json.dumps(value)} is not supported: {instead}", "unsupported_parameter",
                               key)
            continue
        if key not in fields:
            raise ApiError(400, f"unknown field {key!r}: this endpoint takes {', '.join(fields)}", "unknown_parameter",
                           key)
        types, words = fields[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ApiError(400, f"{key} must be {words} (got {json.dumps(value)})", "invalid_type", key)
    given = {k: v for k, v in body.items() if v is not None and k in fields}
    if given.get("model", model_name) != model_name:
        raise ApiError(404, f"the model {given['model']!r} does not exist: this server serves {model_name!r}",
                       "model_not_found", "model")
    stream = given.get("stream", False)
    options = given.get("stream_options", {})
    if options and not stream:
        raise ApiError(400, "stream_options needs stream: true", "invalid_parameter", "stream_options")
    for key, value in options.items():
        if key != "include_usage" or not isinstance(value, bool):
            raise ApiError(400, f"stream_options takes include_usage (true or false) only (got {key!r})",
                           "invalid_parameter", "stream_options")
    stop = given.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", "invalid_type", "stop")
    max_tokens = given.get("max_tokens")
    if chat and "max_completion_tokens" in given:
        if max_tokens is not None and max_tokens != given["max_completion_tokens"]:
            raise ApiError(400, "max_tokens and max_completion_tokens differ: give one of them", "invalid_parameter",
                           "max_completion_tokens")
        max_tokens = given["max_completion_tokens"]
    if chat and "messages" not in given:
        raise ApiError(400, "messages is required: a list of {'role': ..., 'content': ...}", "missing_parameter",
                       "messages")
    if not chat and "prompt" not in given:
        raise ApiError(400, "prompt is required: a string", "missing_parameter", "prompt")
    prompt = _messages(given["messages"]) if chat else _prompt(given["prompt"])
    try:
        sampling = SamplingParams(float(given.get("temperature", DEFAULT_TEMPERATURE)), given.get("top_k", 0),
                                  float(given.get("top_p", 1.0)))
        req = replace(template, max_new_tokens=1 if max_tokens is None else max_tokens, sampling=sampling,
                      stop=tuple(stop), seed=given.get("seed"))
        ids = engine.prompt_ids(prompt, chat=chat)
    except CasspecError as e:
        raise ApiError(400, str(e), "invalid_parameter", _param_of(str(e), chat)) from None
    if max_tokens is None:  # OpenAI's default: up to the context window
        req = replace(req, max_new_tokens=engine.cache.capacity - len(ids))
    return Call(ids, req, stream, bool(options.get("include_usage", False)))


def _param_of(message: str, chat: bool) -> str | None:
    """The field a Request check's message is about (the checks name their own parameter first)."""
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop",
             "max_new_tokens": "max_tokens", "the prompt": "messages" if chat else "prompt",
             "chat messages": "messages"}
    return next((param for start, param in names.items() if message.startswith(start)), None)


def _messages(messages: list) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with role and content", "invalid_type", "messages")
        for key in m:
            if key not in ("role", "content") and m[key] is not None:
                raise ApiError(400, f"messages[{i}].{key} is not supported: a message has a role and a content",
                               "unsupported_parameter", "messages")
        if m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)} (got {m.get('role')!r})",
                           "invalid_parameter", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                               "supported", "unsupported_parameter", "messages")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "invalid_type", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(prompt: str | list) -> str:
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        raise ApiError(400, "prompt must be one string: batches of prompts and prompts of token ids are not "
                       "supported", "unsupported_parameter", "prompt")
    return prompt
