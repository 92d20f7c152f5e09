"""OpenAI request bodies checked and turned into what the generator needs, refusals in OpenAI's words.

Every refusal is an `ApiError` naming the parameter at fault (`param`), as OpenAI's own API does, so that a
client shows the user which argument to fix. Parameters we do not know are ignored: clients send many
(`user`, `metadata`, `store`, penalties, `logit_bias`, `tools`, ...). Those whose effect we cannot honour and
whose absence would change the shape of the answer (n > 1, best_of > 1, echo, suffix) are refused instead.

Checking comes in two steps, so that tokenizing (slow for long prompts: the caller runs it in a worker thread,
see `tokenizing.py`) comes last: `parse_completion`/`parse_chat` check every parameter, and refuse a prompt that
is not valid Unicode or too long in characters for any tokenization to fit the context; the `PendingRequest`
they return becomes a `GenerationRequest` once its prompt is tokenized (`finish`), which checks the length in
tokens. Every number must be finite: Python's JSON parser takes NaN and Infinity (and 1e999 as infinity), and
NaN passes every range check (`NaN < 0` is false), so `load_body` refuses them wherever they are in the body.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from hetnode.coordinator.generation import GenerationParams, Generator
from hetnode.coordinator.tokenizing import lone_surrogate
from hetnode.errors import ConfigError
from hetnode.sampling_params import SamplingParams

# Without max_tokens a request gets this many tokens at most (fewer where the context ends sooner).
DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty: OpenAI's bounds (we take and ignore them)
MAX_LOGIT_BIAS = 100.0  # logit_bias values: OpenAI's bounds (taken and ignored)
SEED_LO, SEED_HI = -(1 << 63), 1 << 64  # OpenAI takes int64 seeds; we also take uint64
# OpenAI's newer "developer" role is the system prompt under another name; chat templates know "system".
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a decimal", str: "a string", list: "an array",
               dict: "an object"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def openai_error(status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> JSONResponse:
    """An error in OpenAI's JSON shape (the same as `api.error_response`, plus `param`)."""
    kind = type_ or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": _printable(message), "type": kind, "param": _printable(param),
                                   "code": code}}, status_code=status)


def _printable(text: str | None) -> str | None:
    # A message quoting the client's own string (a model name) may hold a lone surrogate, which UTF-8 cannot
    # encode: escape it rather than fail the error answer itself with a 500.
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, *, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The `error` object alone, for an error that happens after a stream has begun."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"message": _printable(message), "type": kind, "param": _printable(param), "code": code}


class ApiError(Exception):
    """A request the API refuses; `response()` is the answer to send."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def response(self) -> JSONResponse:
        return openai_error(self.status, self.message, param=self.param, code=self.code)


@dataclass(frozen=True)
class GenerationRequest:
    """One validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    model: str
    prompt_ids: list[int]
    params: GenerationParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a usage chunk before [DONE]
    logprobs: int | None  # None: no logprobs in the answer; k: the sampled token's and the top k
    # vLLM's extension: name logprob tokens "token_id:N" (exact ids, even for tokens that are not valid text).
    tokens_as_ids: bool = False


@dataclass(frozen=True)
class _Options:
    """Everything of a request but its prompt, checked."""

    stream: bool
    include_usage: bool
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    max_tokens: int | None
    max_tokens_key: str
    logprobs: int | None
    tokens_as_ids: bool


@dataclass(frozen=True)
class PendingRequest:
    """A request checked in everything but its length in tokens: its prompt is still to be tokenized.

    The prompt is one of: `text` (completions), `messages` (chat), `ids` (token ids sent as they are).
    """

    chat: bool
    model: str
    prompt_param: str
    options: _Options
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    ids: list[int] | None = None

    def finish(self, prompt_ids: list[int], generator: Generator) -> GenerationRequest:
        """The request with its tokenized prompt; refuses a prompt that leaves no room in the context."""
        return _finish(self, prompt_ids, generator)


def load_body(raw: bytes) -> Any:
    """The JSON body; ApiError for bad JSON and for a non-finite number anywhere in it (naming where)."""
    non_finite = False

    def constant(name: str) -> float:  # NaN, Infinity, -Infinity
        nonlocal non_finite
        non_finite = True
        return float(name)

    def decimal(text: str) -> float:
        nonlocal non_finite
        value = float(text)
        non_finite |= not math.isfinite(value)  # 1e999 reads as infinity
        return value

    try:
        body = json.loads(raw, parse_constant=constant, parse_float=decimal)
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurdly deep nesting
        raise ApiError(f"We could not parse the JSON body of your request ({exc}). The OpenAI API expects a JSON "
                       "payload.") from exc
    if non_finite:  # rare: only then walk the body to say where
        where, value = _first_non_finite(body)
        raise ApiError(f"Invalid '{where}': expected a finite number, but got {_json_number(value)} instead.",
                       param=where)
    return body


def check_model(body: Mapping[str, Any], generator: Generator) -> str:
    model: str | None = _opt(body, "model", str)
    if model is None:
        raise ApiError("you must provide a model parameter", param="model")
    if model != generator.model_name:
        raise ApiError(f"The model `{model}` does not exist or you do not have access to it. "
                       f"This server serves `{generator.model_name}`.",
                       param="model", status=404, code="model_not_found")
    return model


def parse_completion(body: Any, generator: Generator, *, max_chars: int) -> PendingRequest:
    """Check a /v1/completions body; `max_chars` is the longest prompt text that could fit the context."""
    body = _object(body)
    model = check_model(body, generator)
    _refuse_unless(body, "echo", lambda v: v in (None, False), "echo is not supported")
    _refuse_unless(body, "suffix", lambda v: v in (None, ""), "suffix is not supported")
    _refuse_unless(body, "best_of", lambda v: v in (None, 1), "only best_of=1 is supported")
    logprobs = _opt_int(body, "logprobs", 0, MAX_LOGPROBS)
    prompt = _completion_prompt(body, generator)
    if isinstance(prompt, str):
        _check_text_size(len(prompt), max_chars, generator, "prompt")
    options = _options(body, max_tokens_key="max_tokens", logprobs=logprobs)
    if isinstance(prompt, str):
        return PendingRequest(chat=False, model=model, prompt_param="prompt", options=options, text=prompt)
    return PendingRequest(chat=False, model=model, prompt_param="prompt", options=options, ids=prompt)


def parse_chat(body: Any, generator: Generator, *, max_chars: int) -> PendingRequest:
    """Check a /v1/chat/completions body; `max_chars` as for `parse_completion` (the messages' text together)."""
    body = _object(body)
    model = check_model(body, generator)
    want_logprobs = _opt(body, "logprobs", bool) or False
    top = _opt_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise ApiError("Invalid 'top_logprobs': requires 'logprobs' to be true.", param="top_logprobs")
    messages = _chat_messages(body)
    # The template only adds text around the messages, so their text alone bounds the rendered prompt.
    _check_text_size(sum(len(m["content"]) for m in messages), max_chars, generator, "messages")
    # max_tokens is deprecated in chat but still what most clients send.
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    options = _options(body, max_tokens_key=key, logprobs=(top or 0) if want_logprobs else None)
    return PendingRequest(chat=True, model=model, prompt_param="messages", options=options, messages=messages)


# -- prompts --------------------------------------------------------------------------------------------------


def _completion_prompt(body: Mapping[str, Any], generator: Generator) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError("Missing required parameter: 'prompt'.", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check_unicode(prompt, "prompt", "the prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        vocab = generator.model_config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ApiError(f"Invalid 'prompt': token ids must be in [0, {vocab}).", param="prompt")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError("Invalid 'prompt': this server takes one prompt per request; send a string or a list of "
                       "token ids.", param="prompt")
    raise ApiError("Invalid type for 'prompt': expected a string, an array of token ids, or an array of one "
                   "of those.", param="prompt")


def _check_unicode(text: str, param: str, what: str) -> None:
    at = lone_surrogate(text)
    if at is not None:
        raise ApiError(f"Invalid '{param}': {what} is not valid Unicode: lone surrogate at character {at} "
                       f"({text[at]!r}). Send text as UTF-8; a JSON \\u escape must pair a high surrogate with a "
                       "low one.", param=param)


def _check_text_size(chars: int, max_chars: int, generator: Generator, param: str) -> None:
    if chars > max_chars:
        ctx = generator.model_config.max_position_embeddings
        raise ApiError(f"This model's maximum context length is {ctx} tokens. However, your {param} has {chars} "
                       f"characters, more than any tokenization fits in that context (at most {max_chars} "
                       f"characters). Please reduce the length of the {param}.", param=param,
                       code="context_length_exceeded")


def _chat_messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError("Missing required parameter: 'messages'.", param="messages")
    if not isinstance(messages, list):
        raise ApiError(f"Invalid type for 'messages': expected an array, but got {_type_name(messages)} instead.",
                       param="messages")
    if not messages:
        raise ApiError("Invalid 'messages': empty array. Expected an array with minimum length 1, but got an "
                       "empty array instead.", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"Invalid type for '{where}': expected an object, but got {_type_name(m)} instead.",
                           param=where)
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(f"Invalid value for '{where}.role': {role!r}. Supported values are: 'system', "
                           "'developer', 'user' and 'assistant'.", param=f"{where}.role")
        out.append({"role": ROLES[role], "content": _message_text(m.get("content"), role, f"{where}.content")})
    return out


def _message_text(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        _check_unicode(content, where, "the message")
        return content
    if content is None and role == "assistant":  # an assistant turn that only called tools
        return ""
    if not isinstance(content, list):
        raise ApiError(f"Invalid type for '{where}': expected a string or an array of text parts, but got "
                       f"{_type_name(content)} instead.", param=where)
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ApiError(f"Invalid '{where}[{j}]': only text parts ({{'type': 'text', 'text': ...}}) are "
                           "supported.", param=f"{where}[{j}]")
        _check_unicode(part["text"], f"{where}[{j}].text", "the message")
        texts.append(part["text"])
    # As vLLM does: separate parts so that words at their edges do not run together.
    return "\n".join(texts)


# -- everything else ------------------------------------------------------------------------------------------


def _options(body: Mapping[str, Any], *, max_tokens_key: str, logprobs: int | None) -> _Options:
    n = _opt_int(body, "n", 1, None)
    if n not in (None, 1):
        raise ApiError("Invalid 'n': this server generates one choice per request (n=1).", param="n")
    stream = _opt(body, "stream", bool) or False
    options = _opt(body, "stream_options", dict) or {}
    include_usage = _opt(options, "include_usage", bool, name="stream_options.include_usage") or False
    temperature = _opt_float(body, "temperature", 0.0, MAX_TEMPERATURE)
    top_p = _opt(body, "top_p", float)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ApiError(f"Invalid 'top_p': expected a value in (0, 1], but got {top_p} instead.", param="top_p")
    top_k = _opt_int(body, "top_k", 0, None)  # an extension (vLLM, llama.cpp); 0: off
    seed = _opt_int(body, "seed", SEED_LO, SEED_HI - 1)
    # Taken and ignored, but checked as OpenAI checks them: a client's mistake should not pass silently.
    _opt_float(body, "presence_penalty", -MAX_PENALTY, MAX_PENALTY)
    _opt_float(body, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY)
    _logit_bias(body)
    return _Options(stream=stream, include_usage=include_usage, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed=seed, stop=_stop_strings(body), max_tokens=_opt_int(body, max_tokens_key, 1, None),
                    max_tokens_key=max_tokens_key, logprobs=logprobs,
                    tokens_as_ids=bool(_opt(body, "return_tokens_as_token_ids", bool)))


def _logit_bias(body: Mapping[str, Any]) -> None:
    bias = _opt(body, "logit_bias", dict)
    for token in bias or {}:
        _opt_float(bias, token, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, name=f"logit_bias.{token}")


def _finish(pending: PendingRequest, prompt_ids: list[int], generator: Generator) -> GenerationRequest:
    o, prompt_param = pending.options, pending.prompt_param
    if not prompt_ids:
        bos = generator.model_config.bos_token_id
        if bos < 0:
            raise ApiError(f"Invalid '{prompt_param}': the prompt is empty and the model has no BOS token to start "
                           "from.", param=prompt_param)
        prompt_ids = [bos]
    ctx = generator.model_config.max_position_embeddings
    p = len(prompt_ids)
    if p >= ctx:
        raise ApiError(f"This model's maximum context length is {ctx} tokens. However, your {prompt_param} "
                       f"resulted in {p} tokens, which leaves no room for a completion. Please reduce the "
                       f"length of the {prompt_param}.", param=prompt_param, code="context_length_exceeded")
    max_tokens = o.max_tokens
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, ctx - p)
    elif p + max_tokens > ctx:
        # OpenAI refuses rather than clamping: a caller asking for more than fits learns it at once.
        raise ApiError(f"This model's maximum context length is {ctx} tokens. However, you requested "
                       f"{p + max_tokens} tokens ({p} in the {prompt_param}, {max_tokens} in the completion). "
                       f"Please reduce the length of the {prompt_param} or completion.",
                       param=o.max_tokens_key, code="context_length_exceeded")

    tok = generator.tokenizer
    eos = set(generator.model_config.eos_token_ids)
    if tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    try:
        sampling = SamplingParams(
            temperature=1.0 if o.temperature is None else o.temperature,
            top_p=1.0 if o.top_p is None else o.top_p,
            top_k=o.top_k or 0,
            seed=None if o.seed is None else o.seed % SEED_HI,
            stop_token_ids=tuple(sorted(eos)),
            logprobs=o.logprobs,
        )
    except ConfigError as exc:  # a bound of the engine's that is tighter than OpenAI's
        raise ApiError(f"Invalid '{exc.key}': {exc.problem}", param=exc.key) from exc
    return GenerationRequest(chat=pending.chat, model=pending.model, prompt_ids=prompt_ids,
                             params=GenerationParams(max_tokens=max_tokens, sampling=sampling), stop=o.stop,
                             stream=o.stream, include_usage=o.include_usage, logprobs=o.logprobs,
                             tokens_as_ids=o.tokens_as_ids)


def _stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError("Invalid type for 'stop': expected a string or an array of strings.", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(f"Invalid 'stop': array too long. Expected an array with maximum length "
                       f"{MAX_STOP_STRINGS}, but got an array with length {len(stop)} instead.", param="stop")
    # An empty stop string would match before the first character; it can only be a client's placeholder.
    return tuple(s for s in stop if s)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, not {_type_name(body)}")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _opt(body: Mapping[str, Any], key: str, kind: type, *, name: str | None = None) -> Any:
    """body[key] if present and not null, checked to be of `kind` (an int passes for a float, a bool never for
    a number)."""
    name = name or key
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and _is_int(value):
        try:
            ok, value = True, float(value)
        except OverflowError as exc:  # an integer of 309 digits or more
            raise ApiError(f"Invalid '{name}': expected a finite number, but got an integer too large for "
                           "one.", param=name) from exc
    if not ok:
        raise ApiError(f"Invalid type for '{name}': expected {_TYPE_NAMES[kind]}, but got {_type_name(value)} "
                       "instead.", param=name)
    if kind is float and not math.isfinite(value):  # load_body refuses these already; a body from elsewhere
        raise ApiError(f"Invalid '{name}': expected a finite number, but got {_json_number(value)} instead.",
                       param=name)
    return value


def _opt_int(body: Mapping[str, Any], key: str, lo: int | None, hi: int | None) -> int | None:
    value: int | None = _opt(body, key, int)
    if value is not None:
        _check_range(key, value, lo, hi)
    return value


def _opt_float(body: Mapping[str, Any], key: str, lo: float, hi: float, *, name: str | None = None) -> float | None:
    value: float | None = _opt(body, key, float, name=name)
    if value is not None:
        _check_range(name or key, value, lo, hi)
    return value


def _first_non_finite(body: Any) -> tuple[str, float]:
    """The path (as OpenAI names params: `a.b`, `a[0]`) and value of the first non-finite number in `body`."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path or "body", value
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    raise AssertionError("the JSON parser saw a non-finite number that the body does not hold")


def _json_number(value: float) -> str:
    """NaN, Infinity, -Infinity: as the client wrote them, not as Python prints them (nan, inf)."""
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity") if math.isinf(value) else \
        repr(value)


def _check_range(key: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise ApiError(f"Invalid '{key}': expected a value >= {lo}, but got {value} instead.", param=key)
    if hi is not None and value > hi:
        raise ApiError(f"Invalid '{key}': expected a value <= {hi}, but got {value} instead.", param=key)


def _refuse_unless(body: Mapping[str, Any], key: str, ok: Callable[[Any], bool], reason: str) -> None:
    if not ok(body.get(key)):
        raise ApiError(f"Invalid '{key}': {reason}.", param=key)
