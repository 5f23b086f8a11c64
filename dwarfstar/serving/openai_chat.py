"""`POST /v1/chat/completions`: OpenAI Chat Completions with DeepSeek's `reasoning_content`.

Messages are read as ds4 reads them (DS4_SURFACE §2.3), `function` as `tool`, text parts joined with
nothing between them, except where the API's rules refuse a request (validation.py: empty messages, an
unknown or missing role, an image (serving/images.py) and other non-text parts, `tool_choice` without tools, `n` > 1, an
output budget over the context). Streaming follows §2.7: a role chunk, reasoning and content deltas,
each tool call's header and arguments once its block is accepted (never a call that turns out
invalid: `output.py`), a finish chunk, an optional usage chunk, `[DONE]`.

An invalid tool call (a DSML block the parser gives up) ends the turn with finish `stop` (`length`
when the budget cut it) and no calls; its text, as the model wrote it, follows the content, and the
message carries `invalid_tool_call: {"explanation": WHY}` (a DwarfStar field, like
`reasoning_content`; in a stream, in the finish chunk's delta).

What opencode 1.18 sends (checked by `nox -s clients`): `model`, `messages` (roles system, user,
assistant with `reasoning_content` and `tool_calls`, tool), `tools`, `tool_choice: "auto"`,
`max_tokens`, `stream` and `stream_options.include_usage`, all of them used.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from dwarfstar.prompt.dsml_parser import ContentDelta, ReasoningDelta, ToolArgumentsDelta
from dwarfstar.serving.controls import (
    effort_value,
    output_budget,
    sampling_params,
    stop_strings,
    structured_format,
    think_level_value,
    thinking_switch,
)
from dwarfstar.serving.errors import ApiError, Dialect, bad_request, error_body
from dwarfstar.serving.fields import Fields, read_json_object
from dwarfstar.serving.generation import Event, Failed, Finished, Started, TokenLogprob, ToolCallOpened, Usage, new_id
from dwarfstar.serving.images import Images
from dwarfstar.serving.logprobs import Pending, chat_logprobs, openai_entry
from dwarfstar.serving.service import Knobs, Service
from dwarfstar.serving.sse import respond, sse
from dwarfstar.serving.validation import check_tool_choice, media_refused, non_empty, unknown_role, unsupported_part

ROLES = ("system", "developer", "user", "assistant", "latest_reminder")
TEXT_PARTS = ("text", "input_text", "output_text")


def content_text(content: Any, where: str, images: Images, *, tool: bool = False) -> str:
    """String content, or the text parts of a list joined with nothing between (an assistant's
    `refusal` parts left out); an `image_url` part read into `images`, its slot in its place
    (serving/images.py); any other part is refused, or in a tool result (`tool`) written as
    `[Unsupported TYPE]` (validation.py, `media`)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string, an array of parts or null", param=f"{where}.content")
    texts = []
    for m, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            texts.append(images.read(part, kind, f"{where}.content[{m}]", tool=tool))
        elif tool:
            texts.append(unsupported_part(kind))
        elif kind != "refusal":
            raise media_refused(kind, f"{where}.content[{m}]")
    return "".join(texts)


def openai_messages(raw: list[Any] | None, images: Images) -> list[dict[str, Any]]:
    messages = []
    for n, message in enumerate(non_empty(raw, "messages")):
        where = f"messages[{n}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", param=where)
        role = message.get("role")
        if role in ("tool", "function"):
            text = content_text(message.get("content"), where, images, tool=True)
            messages.append({"role": "tool", "tool_call_id": message.get("tool_call_id") or "", "content": text})
        elif role in ROLES:
            out: dict[str, Any] = {"role": role, "content": content_text(message.get("content"), where, images)}
            if role == "assistant":
                for key in ("reasoning_content", "tool_calls"):
                    if message.get(key) is not None:
                        out[key] = message[key]
            messages.append(out)
        else:
            raise unknown_role(role, where, (*ROLES, "tool", "function"))
    return messages


def openai_tools(fields: Fields) -> list[dict[str, Any]]:
    """`tools` checked: each `{"type": "function", "function": {"name", "parameters"?...}}`, and
    `tool_choice` against them (validation.py, `tool_choice`)."""
    tools = fields.array("tools") or []
    for n, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise bad_request(f'tools[{n}] must be {{"type": "function", "function": {{"name": ...}}}}', f"tools[{n}]")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise bad_request(f"tools[{n}].function.parameters must be an object", f"tools[{n}].function.parameters")
    choice, named = fields.raw("tool_choice"), None
    if isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if not isinstance(named, str):
            raise bad_request('tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    elif choice not in (None, "none", "auto", "required"):
        raise bad_request(
            f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}', "tool_choice"
        )
    names = [tool["function"]["name"] for tool in tools]
    check_tool_choice(choice, names, named=named, needs_tools=named is not None or choice == "required")
    if choice == "none":
        return []  # ds4: no tools section at all
    return tools


def usage_chunk(fields: Fields) -> bool:
    """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
    options = fields.mapping("stream_options")
    return bool(options and options.flag("include_usage"))


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.prefilled_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            # OpenAI's predicted-output fields, here the MTP drafts (serve --mtp) accepted and rejected
            "accepted_prediction_tokens": usage.accepted_draft_tokens,
            "rejected_prediction_tokens": usage.draft_tokens - usage.accepted_draft_tokens,
        },
    }


def stream_error(message: str) -> list[bytes]:
    """The end of an OpenAI stream whose generation failed (the SDKs raise `APIError` on it)."""
    return [sse(error_body(ApiError(500, message, code="server_error"), Dialect.OPENAI), "error"), b"data: [DONE]\n\n"]


async def chat_completions(request: Request) -> Response:
    service: Service = request.app.state.service
    fields = await read_json_object(request)
    model = service.models.resolve(fields.text("model"))
    images = service.images()
    messages = openai_messages(fields.array("messages"), images)
    if (fields.integer("n", low=1) or 1) != 1:
        raise bad_request("n must be 1: one choice per request", param="n")
    tools = openai_tools(fields)
    kwargs = fields.mapping("chat_template_kwargs")
    switch = thinking_switch(fields, "thinking")
    for source, key in ((fields, "think"), (fields, "enable_thinking"), (kwargs, "enable_thinking")):
        if source is not None and source.flag(key) is not None:
            switch = source.flag(key)
    thinking = service.thinking(model, switch, effort_value(fields, "reasoning_effort"), think_level_value(fields))
    knobs = Knobs(
        api="chat",
        param="messages",
        sampling=replace(sampling_params(fields, thinking), logprobs=chat_logprobs(fields)),
        max_tokens=output_budget(fields, "max_completion_tokens", "max_tokens"),
        stop=stop_strings(fields, "stop"),
        body=fields.body,
    )
    stream, include_usage = bool(fields.flag("stream")), usage_chunk(fields)
    await images.check()
    job = await service.submit_chat(
        messages,
        tools=tools,
        thinking=thinking,
        knobs=knobs,
        response_format=structured_format(fields, "response_format"),
        images=images,
    )
    response_id = new_id("chatcmpl-")
    writer = partial(ChatStream, response_id, model, include_usage)
    return await respond(job, request, stream, writer, partial(chat_completion, response_id, model))


def chat_completion(response_id: str, model: str, done: Finished) -> dict[str, Any]:
    completion = done.completion
    message: dict[str, Any] = {"role": "assistant", "content": done.content}
    if completion.reasoning:
        message["reasoning_content"] = completion.reasoning
    if completion.tool_calls:
        message["tool_calls"] = [
            call.to_openai(i) for call, i in zip(completion.tool_calls, done.tool_ids, strict=True)
        ]
    message |= invalid_call_field(done)
    logprobs = logprobs_object(done.logprobs)
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": openai_finish(done.reason)}
    return envelope("chat.completion", response_id, int(time.time()), model, [choice], usage=usage_object(done.usage))


def invalid_call_field(done: Finished) -> dict[str, Any]:
    """The message's `invalid_tool_call` field when the parser gave up a tool-call block, else nothing."""
    why = done.invalid_tool_call
    return {} if why is None else {"invalid_tool_call": {"explanation": why}}


def envelope(kind: str, response_id: str, created: int, model: str, choices: list[Any], **extra: Any) -> dict[str, Any]:
    """An OpenAI chat or completions object or chunk of type `kind`: its id, times and model around the
    `choices`, then `extra` fields (usage)."""
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}


def openai_finish(reason: str) -> str:
    """OpenAI's finish reason: the loop guard's `repetition` is not among them, and reads as `stop` (the
    output ended on the server's decision, not for lack of room; the trace has the detail)."""
    return "stop" if reason == "repetition" else reason


def logprobs_object(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's `logprobs`: None when the request did not ask (a stream's chunk: or has none to send)."""
    if entries is None:
        return None
    return {"content": [openai_entry(e) for e in entries], "refusal": None}


class ChatStream:
    """Turns job events into `chat.completion.chunk` SSE lines."""

    def __init__(self, response_id: str, model: str, include_usage: bool) -> None:
        self.id, self.model, self.include_usage = response_id, model, include_usage
        self.created = int(time.time())
        self.pending = Pending()  # logprobs of tokens whose text has not been sent yet

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        logprobs = logprobs_object(self.pending.take() or None)
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(self._envelope([choice]))

    def _envelope(self, choices: list[Any], **extra: Any) -> dict[str, Any]:
        return envelope("chat.completion.chunk", self.id, self.created, self.model, choices, **extra)

    def __call__(self, event: Event) -> list[bytes]:
        if isinstance(event, Started):
            return [self._chunk({"role": "assistant", "content": ""})]
        if isinstance(event, TokenLogprob):
            self.pending.entries.append(event)
            return []
        if isinstance(event, ReasoningDelta):
            return [self._chunk({"reasoning_content": event.text})]
        if isinstance(event, ContentDelta):
            return [self._chunk({"content": event.text})]
        if isinstance(event, ToolCallOpened):
            call = {"index": event.index, "id": event.id, "type": "function"}
            call["function"] = {"name": event.name, "arguments": ""}
            return [self._chunk({"tool_calls": [call]})]
        if isinstance(event, ToolArgumentsDelta):
            return [self._chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})]
        if isinstance(event, Finished):
            out = [self._chunk(invalid_call_field(event), openai_finish(event.reason))]
            if self.include_usage:
                out.append(sse(self._envelope([], usage=usage_object(event.usage))))
            return out + [b"data: [DONE]\n\n"]
        if isinstance(event, Failed):
            return stream_error(event.message)
        return []
