"""OpenAPI descriptions of the OpenAI routes, built from the bounds `openai_schema` checks requests against.

The checks themselves stay in `openai_schema` (they name the parameter at fault in OpenAI's words, which a
generic JSON Schema validator cannot); this file states the same bounds from the same constants, and the
schemathesis test (tests/coordinator/test_openapi_fuzz.py) holds the two together: whatever the document
forbids must be refused with a 4xx, and the server must never fail on what it allows. Unknown parameters are
allowed (the server ignores them, as OpenAI clients send many).

What JSON Schema cannot say is left to the prose and the 400 answer: the prompt's length in tokens against the
context, and lone surrogates in strings.
"""

from __future__ import annotations

from hetnode.coordinator.openai_schema import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    ROLES,
    SEED_HI,
    SEED_LO,
)
from hetnode.coordinator.openapi import Operation, Schema


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _common(model: str) -> dict[str, Schema]:
    """The parameters both endpoints take, null meaning absent as OpenAI's API has it."""
    return {
        "model": {"enum": [model]},
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": _nullable({"type": "boolean"})}}),
        "n": _nullable({"const": 1}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": 0}),
        "seed": _nullable({"type": "integer", "minimum": SEED_LO, "maximum": SEED_HI - 1}),
        "stop": _nullable({"anyOf": [{"type": "string"},
                                     {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS}]}),
        "max_tokens": _nullable({"type": "integer", "minimum": 1}),
        "presence_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
        "logit_bias": _nullable({"type": "object", "additionalProperties": _nullable(
            {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS})}),
        "return_tokens_as_token_ids": _nullable({"type": "boolean"}),
    }


def completion_request(model: str, *, vocab_size: int, max_chars: int) -> Schema:
    text: Schema = {"type": "string", "maxLength": max_chars}
    ids: Schema = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                            "maximum": vocab_size - 1}}
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            **_common(model),
            "prompt": {"anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": 1,
                                             "items": {"anyOf": [text, ids]}}]},
            "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
            "echo": _nullable({"const": False}),
            "suffix": _nullable({"const": ""}),
            "best_of": _nullable({"const": 1}),
        },
    }


def chat_request(model: str, *, max_chars: int) -> Schema:
    text: Schema = {"type": "string", "maxLength": max_chars}
    parts: Schema = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "text"}, "text": text}}}
    speaker = sorted(r for r in ROLES if r != "assistant")
    message = {"anyOf": [
        {"type": "object", "required": ["role", "content"],
         "properties": {"role": {"enum": speaker}, "content": {"anyOf": [text, parts]}}},
        # An assistant turn that only called tools has no content.
        {"type": "object", "required": ["role"],
         "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [text, parts, {"type": "null"}]}}},
    ]}
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **_common(model),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
            "logprobs": _nullable({"type": "boolean"}),
            "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
        },
        # top_logprobs needs logprobs: true.
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    }


_USAGE: Schema = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                  "properties": {k: {"type": "integer", "minimum": 0}
                                 for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH: Schema = {"enum": ["stop", "length"]}
# One server-sent event of the stream, as OpenAPI tools read a text/event-stream body (schemathesis checks every
# event of a streamed answer against it): its `data` is a chunk's JSON, or `[DONE]` at the end.
_SSE: Schema = {"type": "object", "required": ["data"],
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                               "retry": {"type": "integer"}},
                "description": "server-sent events: `data: {chunk}` each, then `data: [DONE]`"}


def _answer(obj: str, choice: Schema) -> Schema:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": choice},
        "usage": _USAGE}}


_COMPLETION = _answer("text_completion", {"type": "object", "required": ["index", "text", "finish_reason"],
                                          "properties": {"index": {"const": 0}, "text": {"type": "string"},
                                                         "finish_reason": _FINISH}})
_CHAT = _answer("chat.completion", {"type": "object", "required": ["index", "message", "finish_reason"],
                                    "properties": {"index": {"const": 0}, "finish_reason": _FINISH, "message": {
                                        "type": "object", "required": ["role", "content"], "properties": {
                                            "role": {"const": "assistant"}, "content": {"type": "string"}}}}})
_MODEL: Schema = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}}}

_GENERATION_STATUSES = {
    400: "a parameter is missing, of the wrong type or out of bounds; or the prompt does not fit the context",
    404: "the model is not served here",
    413: "the body is over the size limit",
    503: "no pipeline of nodes can serve the request now",
}


def operations(model: str, *, vocab_size: int, max_chars: int) -> dict[str, Operation]:
    """The operation of each OpenAI route, by the name `openai_api.openai_routes` gives it."""
    return {
        "list_models": Operation(summary="the model served here", ok={"application/json": {
            "type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}}}}),
        "get_model": Operation(summary="one model", ok={"application/json": _MODEL},
                               statuses={404: "the model is not served here"}),
        "completions": Operation(summary="complete a prompt (streamed as server-sent events with stream: true)",
                                 ok={"application/json": _COMPLETION, "text/event-stream": _SSE},
                                 body=completion_request(model, vocab_size=vocab_size, max_chars=max_chars),
                                 statuses=_GENERATION_STATUSES),
        "chat_completions": Operation(summary="answer a conversation (streamed with stream: true)",
                                      ok={"application/json": _CHAT, "text/event-stream": _SSE},
                                      body=chat_request(model, max_chars=max_chars),
                                      statuses=_GENERATION_STATUSES),
    }
