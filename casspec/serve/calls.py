"""What an OpenAI API call may ask of casspec serve: its JSON body, the fields and their checks and limits, and the
Request it becomes.

A call goes through the same checks as `casspec generate` (Request, SamplingParams, Engine.prompt_ids: the same
messages). Fields casspec does not do get a 400 unless they hold the value that asks for nothing; unknown fields
get a 400 too: nothing is silently ignored. `Limits` bound what one call and its client may cost (body, prompt,
stops, max_tokens here; deadline, stalls and connections in the server); the prompt's size is checked in
characters before it is templated and tokenized.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dsia.errors import CasspecError
from dytc.sampling import SamplingParams

from ..cache.usercache import json_depth

if TYPE_CHECKING:  # (annotations only: the CLI reads Limits without the engine or the serve extra)
    from starlette.responses import Response

    from ..runtime.engine import Engine
    from ..runtime.request import Request

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default for a call that names none (0 = greedy)
ROLES = ("system", "user", "assistant")  # chat roles handed to the chat template (no tool messages)
MAX_JSON_DEPTH = 16  # nesting of a call's JSON body (a valid call nests 5 deep: body, messages, message, parts, part)
PROMPT_CHARS_PER_TOKEN = 16  # a prompt longer than this many characters per token of the prompt limit is refused
# before it is tokenized (no tokenizer's tokens are that long on average)
SHOWN_CHARS = 60  # of a refused value, in its error message


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "code", "param"}}."""
    TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "code": self.code, "param": self.param}}

    def response(self) -> Response:
        """(ASCII JSON: a lone surrogate in an echoed field name cannot break the encoding)"""
        from starlette.responses import Response

        return Response(json.dumps(self.body()), self.status, self.headers, media_type="application/json")


def check_positive(name: str, value: object, integer: bool = True, least: int = 1) -> None:
    """A setting that must be an integer >= least (integer) or a finite number > 0: one clear error otherwise."""
    if integer and (isinstance(value, bool) or not isinstance(value, int) or value < least):
        raise CasspecError(f"{name} must be an integer >= {least} (got {value!r})")
    if not integer and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
        raise CasspecError(f"{name} must be a number of seconds > 0 (got {value!r})")


@dataclass(frozen=True)
class Limits:
    """What one call and its client may cost. A call over a limit gets a 400 naming the parameter (the body a 413),
    before any work; the timeouts and the connection cap are kept by the server (serve.py, guard.py)."""
    max_body_bytes: int = 1 << 20  # a call's body (1 MiB: some 250k tokens of English); longer gets 413, unread
    max_prompt_tokens: int | None = None  # the prompt after the chat template; None: the context window
    default_max_tokens: int = 1024  # max_tokens of a call that names none (less where the context holds less)
    max_tokens_limit: int = 8192  # the most max_tokens (or max_completion_tokens) a call may ask
    max_stops: int = 16  # stop strings per call (OpenAI takes 4; clients of local servers send a few more)
    max_stop_chars: int = 256  # characters per stop string
    request_timeout: float = 300.0  # seconds from a call's arrival to its end: past them its generation ends with
    # finish_reason "length" (the text so far), and a call still waiting for the engine gets 503
    client_timeout: float = 30.0  # seconds a client may stall sending a request (its head, or its body: 408) or
    # not taking a stream; past them its connection is closed
    max_connections: int = 64  # open connections (uvicorn's limit_concurrency); one more is answered 503

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "default_max_tokens", "max_tokens_limit", "max_stops", "max_stop_chars",
                     "max_connections"):
            check_positive(name, getattr(self, name))
        for name in ("request_timeout", "client_timeout"):
            check_positive(name, getattr(self, name), integer=False)
        if self.max_prompt_tokens is not None:
            check_positive("max_prompt_tokens", self.max_prompt_tokens)
        if self.default_max_tokens > self.max_tokens_limit:
            raise CasspecError(f"default_max_tokens ({self.default_max_tokens}) is over max_tokens_limit "
                               f"({self.max_tokens_limit}): lower it, or raise the limit")


LIMITS_HELP = {  # Limits field -> what `casspec serve --FIELD` does
    "max_body_bytes": "bytes of a request body; more gets 413, not read",
    "max_prompt_tokens": "prompt tokens after the chat template (default: the context window)",
    "default_max_tokens": "max_tokens of a call that names none, at most the room left in the context",
    "max_tokens_limit": "the most max_tokens a call may ask",
    "max_stops": "stop strings per call",
    "max_stop_chars": "characters per stop string",
    "request_timeout": "seconds from a call's arrival to its end: a generation then ends with finish_reason "
                       "length, a call still waiting gets 503",
    "client_timeout": "seconds a client may stall sending a request or not reading a stream before its "
                      "connection is closed",
    "max_connections": "open connections; one more is answered 503",
}


MAX_USER_CHARS = 256  # longest OpenAI `user` id accepted
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
    "user": ((str,), "a string"),  # OpenAI's end-user id: with the API key, whose memory the free sources use
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


def read_json(raw: bytes) -> Any:
    """A call's body as JSON: 400 for anything else, and for nesting deeper than MAX_JSON_DEPTH (the parser's own
    recursion limit included: never a RecursionError). NaN, Infinity and numbers beyond float's range are read:
    the fields that take numbers refuse them, naming themselves."""
    too_deep = ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except ValueError:  # (bytes that are not UTF-8, and integers of more digits than Python reads, included)
        raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None
    if json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise too_deep
    return body


def parse_call(body: Any, chat: bool, engine: Engine, template: Request, model_name: str,
               limits: Limits = Limits(), key: str = "") -> Call:
    """Check a call's JSON body and build its Request; ApiError (400, 404) for anything wrong, unsupported or over
    `limits`. The prompt is measured in characters before it is templated and tokenized. key: the caller's API key
    digest; with the call's `user` it names the client whose memory of earlier generations the recycle and suffix
    sources use (Request.tenant)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_request")
    given = _given(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    if given.get("model", model_name) != model_name:
        raise ApiError(404, f"the model {_show(repr(given['model']))} does not exist: this server serves "
                       f"{model_name!r}", "model_not_found", "model")
    stream, include_usage = _stream(given)
    user = given.get("user", "")
    if len(user) > MAX_USER_CHARS:
        raise ApiError(400, f"user is {len(user)} characters long: send an id of at most {MAX_USER_CHARS}",
                       "invalid_value", "user")
    stop = _stops(given.get("stop", []), limits)
    max_tokens = _max_tokens(given, chat, limits)
    if chat and "messages" not in given:
        raise ApiError(400, "messages is required: a list of {'role': ..., 'content': ...}", "missing_parameter",
                       "messages")
    if not chat and "prompt" not in given:
        raise ApiError(400, "prompt is required: a string", "missing_parameter", "prompt")
    prompt = _messages(given["messages"]) if chat else _prompt(given["prompt"])
    try:
        req = replace(template, max_new_tokens=1 if max_tokens is None else max_tokens,
                      sampling=_sampling(given, engine), stop=stop, seed=given.get("seed"), tenant=f"{key}/{user}")
        ids = _prompt_ids(engine, prompt, chat, limits)  # (the costly check last)
    except CasspecError as e:
        raise _request_error(str(e), chat) from None
    room = engine.cache.capacity - len(ids)  # (>= 1: the engine's check)
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"the prompt has {len(ids)} tokens and max_tokens asks for {max_tokens} more, but the "
                       f"context window holds {engine.cache.capacity}: shorten the prompt or lower max_tokens",
                       "context_length_exceeded", "messages" if chat else "prompt")
    req = replace(req, max_new_tokens=min(limits.default_max_tokens, room) if max_tokens is None else max_tokens)
    return Call(ids, req, stream, include_usage)


def _given(body: dict, fields: dict) -> dict:
    """The fields a call sets (null: not set), each of an accepted type; unsupported and unknown ones refused."""
    for key, value in body.items():
        if value is None:
            continue
        if key in UNSUPPORTED:
            neutral, instead = UNSUPPORTED[key]
            if not any(type(value) is type(n) and value == n for n in neutral):
                raise ApiError(400, f"{key}={_show(json.dumps(value))} is not supported: {instead}",
                               "unsupported_parameter", key)
            continue
        if key not in fields:
            raise ApiError(400, f"unknown field {_show(repr(key))}: this endpoint takes {', '.join(fields)}",
                           "unknown_parameter", key[:SHOWN_CHARS])
        types, words = fields[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ApiError(400, f"{key} must be {words} (got {_show(json.dumps(value))})", "invalid_type", key)
    return {k: v for k, v in body.items() if v is not None and k in fields}


def _stream(given: dict) -> tuple[bool, bool]:
    """stream, and stream_options.include_usage."""
    stream = given.get("stream", False)
    options = given.get("stream_options", {})
    if options and not stream:
        raise ApiError(400, "stream_options needs stream: true", "invalid_parameter", "stream_options")
    for key, value in options.items():
        if key != "include_usage" or not isinstance(value, bool):
            raise ApiError(400, f"stream_options takes include_usage (true or false) only (got {_show(repr(key))})",
                           "invalid_parameter", "stream_options")
    return stream, bool(options.get("include_usage", False))


def _stops(stop: str | list, limits: Limits) -> tuple[str, ...]:
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", "invalid_type", "stop")
    if len(stop) > limits.max_stops:
        raise ApiError(400, f"stop holds {len(stop)} strings: this server takes at most {limits.max_stops}",
                       "invalid_parameter", "stop")
    if longest := max((len(s) for s in stop if len(s) > limits.max_stop_chars), default=0):
        raise ApiError(400, f"a stop string has {longest} characters: this server takes at most "
                       f"{limits.max_stop_chars} per stop string", "invalid_parameter", "stop")
    if "" in stop:
        raise ApiError(400, "stop strings must not be empty: drop the empty string from stop", "invalid_parameter",
                       "stop")
    return tuple(stop)


def _max_tokens(given: dict, chat: bool, limits: Limits) -> int | None:
    """The call's max_tokens (chat: or max_completion_tokens), at most the limit; None when it names none."""
    max_tokens, param = given.get("max_tokens"), "max_tokens"
    if chat and "max_completion_tokens" in given:
        if max_tokens is not None and max_tokens != given["max_completion_tokens"]:
            raise ApiError(400, "max_tokens and max_completion_tokens differ: give one of them", "invalid_parameter",
                           "max_completion_tokens")
        max_tokens, param = given["max_completion_tokens"], "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:  # (named as the API names it, not as the engine's Request does)
        raise ApiError(400, f"{param} must be an integer >= 1 (got {_show(str(max_tokens))})", "invalid_parameter",
                       param)
    if max_tokens is not None and max_tokens > limits.max_tokens_limit:
        raise ApiError(400, f"{param} is {_show(str(max_tokens))}: this server generates at most "
                       f"{limits.max_tokens_limit} tokens per call", "invalid_parameter", param)
    return max_tokens


def _sampling(given: dict, engine: Engine) -> SamplingParams:
    """temperature, top_p and top_k, finite and in range (the range checks and messages are SamplingParams')."""
    vocab = engine.model.spec.vocab_size
    if given.get("top_k", 0) > vocab:
        raise CasspecError(f"top_k must be at most the vocabulary's {vocab} tokens (got "
                           f"{_show(str(given['top_k']))}); use 0 to turn it off")
    return SamplingParams(_finite(given, "temperature", DEFAULT_TEMPERATURE), given.get("top_k", 0),
                          _finite(given, "top_p", 1.0))


def _finite(given: dict, key: str, default: float) -> float:
    try:
        value = float(given.get(key, default))
    except OverflowError:  # an integer beyond float's range
        value = math.inf
    if not math.isfinite(value):
        raise CasspecError(f"{key} must be a finite number (got {_show(json.dumps(given[key]))})")
    return value


def _prompt_ids(engine: Engine, prompt: str | list[dict], chat: bool, limits: Limits) -> list[int]:
    """The prompt's token ids: its characters and messages counted before templating and tokenizing, its tokens
    after."""
    cap = min(limits.max_prompt_tokens or engine.cache.capacity, engine.cache.capacity)
    chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
    if chars > PROMPT_CHARS_PER_TOKEN * cap:
        raise CasspecError(f"the prompt has {chars} characters: more than this server tokenizes for a prompt of at "
                           f"most {cap} tokens ({PROMPT_CHARS_PER_TOKEN} per token); shorten the prompt")
    if not isinstance(prompt, str) and len(prompt) > cap:
        raise CasspecError(f"the prompt has {len(prompt)} messages: more than the {cap} tokens a prompt may have; "
                           "shorten the conversation")
    ids = engine.prompt_ids(prompt, chat=chat)  # (its checks: not empty, in the context, ids in the vocabulary)
    if len(ids) > cap:
        raise CasspecError(f"the prompt has {len(ids)} tokens but this server takes at most {cap} "
                           "(max_prompt_tokens): shorten the prompt")
    return ids


def _request_error(message: str, chat: bool) -> ApiError:
    """A Request or prompt check's CasspecError as a 400 naming the field it is about (the checks name it first)."""
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop",
             "max_new_tokens": "max_tokens", "the prompt": "messages" if chat else "prompt",
             "chat messages": "messages"}
    param = next((p for start, p in names.items() if message.startswith(start)), None)
    too_long = message.startswith("the prompt has")
    return ApiError(400, message, "context_length_exceeded" if too_long else "invalid_parameter", param)


def _messages(messages: list) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with role and content", "invalid_type", "messages")
        for key in m:
            if key not in ("role", "content") and m[key] is not None:
                raise ApiError(400, f"messages[{i}].{_show(key)} is not supported: a message has a role and a content",
                               "unsupported_parameter", "messages")
        if m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)} (got "
                           f"{_show(repr(m.get('role')))})", "invalid_parameter", "messages")
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


def _show(text: str) -> str:
    """A refused value, as its error message shows it: cut to SHOWN_CHARS characters."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."
