"""`POST /v1/messages` (Anthropic Messages, for Claude Code) and `/v1/messages/count_tokens`.

Content blocks map to the renderer's OpenAI-style messages by their own `type` (DS4_SURFACE §2.3):
`text` is content, `thinking` is reasoning, `tool_use` a tool call, `tool_result` a tool message;
images are read by serving/images.py, documents refused, consecutive user or assistant messages read as one turn, and
`max_tokens` is required (validation.py has these rules). System text blocks are joined by newlines,
without the `x-anthropic-` blocks Claude Code adds, whose text changes every request and would defeat
prefix reuse. Errors use Anthropic's shape. Usage follows ds4: `cache_read_input_tokens` counts reused
prompt tokens, `cache_creation_input_tokens` prefilled ones, so `input_tokens` is 0.

A `system` entry inside `messages` (Claude Code 2.1 puts its environment notes there, after the
first user message) renders where it stands, as the official encoder renders a system message that
is not first, under either template. The request fields current Claude Code sends:
- `thinking` `{"type": "enabled"|"adaptive"|"disabled", "budget_tokens"?, "display"?}`: the type
  switches thinking (adaptive is on); `display: "omitted"` is honoured, thinking blocks come back
  with empty text and their signature; `budget_tokens` is accepted and ignored (no budget here).
  The server keeps the hidden reasoning under its signature (`HiddenThinking`) and puts it back
  when the client returns the empty block, so the next turn's prompt extends the cached KV, which
  holds the sampled reasoning, instead of diverging right after `<think>`.
- `output_config` `{"effort"?, "format"?}`: `effort` picks Think-Max for `max`, `none` turns
  thinking off; `format` `{"type": "json_schema", "schema": ...}` becomes the response format.
- `context_management` `{"edits": [{"type": ...}]}`: checked and ignored. Its edits ask the server
  to clear old thinking or tool results from the context; the renderer already drops old reasoning
  by the encoder's rules, and rewriting history here would break prefix reuse.
- `metadata`, `cache_control` on blocks, `service_tier`: ignored.

An invalid tool call (a DSML block the parser gives up) yields no `tool_use` block: its text, as the
model wrote it, follows the answer in the text block, the turn ends (`end_turn`, or `max_tokens` when
the budget cut it), and `stop_details` is `{"type": "invalid_tool_call", "explanation": WHY}` (null
otherwise; in a stream, in `message_delta`). Claude Code shows the text and ends the turn.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from dwarfstar.prompt.dsml_parser import ContentDelta, ReasoningDelta, ToolArgumentsDelta
from dwarfstar.serving.controls import (
    effort_value,
    output_budget,
    sampling_params,
    stop_strings,
    think_level_value,
    thinking_switch,
)
from dwarfstar.serving.errors import ApiError, Dialect, bad_request, error_body, json_response
from dwarfstar.serving.fields import Fields, read_json_object
from dwarfstar.serving.generation import Event, Failed, Finished, Started, ToolCallOpened, Usage, new_id
from dwarfstar.serving.images import Images
from dwarfstar.serving.service import Knobs, Service
from dwarfstar.serving.sse import respond, sse
from dwarfstar.serving.validation import check_tool_choice, media_refused, non_empty, unsupported_part

# the loop guard's `repetition` ends the turn: `end_turn` (the trace has the detail)
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn", "repetition": "end_turn"}
BILLING_PREFIX = "x-anthropic-"
ROLES = ("user", "assistant", "system")
TOOL_CHOICES = ("auto", "any", "tool", "none")
THINKING_DISPLAYS = ("summarized", "omitted")
HIDDEN_THINKING_KEPT = 1024  # answers whose hidden reasoning is kept; older ones re-prefill from `<think>`


class HiddenThinking:
    """Reasoning sent as an empty thinking block, by the block's signature (the message id)."""

    def __init__(self, capacity: int = HIDDEN_THINKING_KEPT) -> None:
        self.capacity = capacity
        self._texts: OrderedDict[str, str] = OrderedDict()

    def remember(self, signature: str, reasoning: str) -> None:
        self._texts[signature] = reasoning
        self._texts.move_to_end(signature)
        while len(self._texts) > self.capacity:
            self._texts.popitem(last=False)

    def recall(self, signature: Any) -> str | None:
        return self._texts.get(signature) if isinstance(signature, str) else None


def hidden_thinking(request: Request) -> HiddenThinking:
    state = request.app.state
    if not hasattr(state, "hidden_thinking"):
        state.hidden_thinking = HiddenThinking()
    return state.hidden_thinking


def _text_of(content: Any, where: str, images: Images | None = None) -> str:
    """Text blocks joined; in a tool result (given its request's `images`) an image is read, its slot
    in its place (serving/images.py), and another block is `[Unsupported TYPE]`; elsewhere (system
    entries) other blocks are dropped."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content blocks", param=where)
    texts = []
    for m, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif images is not None and kind == "image":
            texts.append(images.read(block, kind, f"{where}[{m}]", tool=True))
        elif images is not None:
            texts.append(unsupported_part(kind))
    return "".join(texts)


def system_text(fields: Fields) -> str:
    system = fields.raw("system")
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        raise bad_request("system must be a string or an array of text blocks", param="system")
    texts = [
        block["text"]
        for block in system
        if isinstance(block, dict)
        and isinstance(block.get("text"), str)
        and not block["text"].startswith(BILLING_PREFIX)
    ]
    return "\n".join(texts)


@dataclass
class _Turn:
    """A run of consecutive user or assistant messages, read as one turn (validation.py, `merge`)."""

    role: str
    texts: list[str] = field(default_factory=list)  # one per message
    reasoning: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)

    def messages(self) -> list[dict[str, Any]]:
        text = "\n\n".join(t for t in self.texts if t)
        if self.role == "user":  # a message of tool results alone is no user turn
            return self.results + ([{"role": "user", "content": text}] if text or not self.results else [])
        out: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            out["tool_calls"] = self.calls
        return [out]


def _read_blocks(turn: _Turn, blocks: list[Any], where: str, hidden: HiddenThinking | None, images: Images) -> None:
    texts = []
    for m, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            recalled = hidden.recall(block.get("signature")) if hidden and not block["thinking"] else None
            turn.reasoning.append(recalled or block["thinking"])
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise bad_request(f"{where}.content[{m}]: tool_use needs a name and an input object", where)
            function = {"name": block["name"], "arguments": block.get("input") or {}}
            turn.calls.append({"id": block.get("id") or "", "type": "function", "function": function})
        elif kind == "tool_result":
            result = _text_of(block.get("content"), f"{where}.content[{m}].content", images)
            turn.results.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": result})
        elif kind == "image":
            texts.append(images.read(block, kind, f"{where}.content[{m}]"))
        elif kind == "document":
            raise media_refused(kind, f"{where}.content[{m}]")
    turn.texts.append("".join(texts))


def anthropic_messages(
    raw: list[Any] | None, system: str, images: Images, hidden: HiddenThinking | None = None
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    turn: _Turn | None = None
    for n, message in enumerate(non_empty(raw, "messages")):
        where = f"messages[{n}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f'{where} must be an object with role "user", "assistant" or "system"', param=where)
        role, content = message["role"], message.get("content")
        if turn is not None and turn.role != role:
            messages += turn.messages()
            turn = None
        if role == "system":
            messages.append({"role": "system", "content": _text_of(content, f"{where}.content"), "in_place": True})
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"{where}.content must be a string or an array of content blocks", f"{where}.content")
        turn = turn or _Turn(role)
        _read_blocks(turn, blocks, where, hidden, images)
    return messages + (turn.messages() if turn is not None else [])


def anthropic_tools(fields: Fields) -> list[dict[str, Any]]:
    tools = fields.array("tools") or []
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{n}] must be an object with a name", param=f"tools[{n}]")
        if tool.get("input_schema") is not None and not isinstance(tool["input_schema"], dict):
            raise bad_request(f"tools[{n}].input_schema must be an object", param=f"tools[{n}].input_schema")
    choice = fields.mapping("tool_choice")
    kind = choice.raw("type") if choice is not None else None
    if choice is not None and kind not in TOOL_CHOICES:
        raise bad_request(f"tool_choice.type must be one of {', '.join(TOOL_CHOICES)}", param="tool_choice.type")
    named = choice.required("name", choice.text("name")) if kind == "tool" else None
    names = [tool["name"] for tool in tools]
    check_tool_choice(kind, names, named=named, needs_tools=kind in ("any", "tool"))
    return [] if kind == "none" else tools


@dataclass
class Conversation:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    thinking: Any
    response_format: dict[str, Any] | None
    show_thinking: bool  # False for `thinking.display: "omitted"`
    images: Images  # serving/images.py, checked before any job


def _thinking_display(fields: Fields) -> str | None:
    thinking = fields.mapping("thinking") if isinstance(fields.raw("thinking"), dict) else None
    if thinking is None:
        return None
    thinking.integer("budget_tokens", low=0)  # checked, then ignored: there is no thinking budget here
    display = thinking.text("display")
    if display is not None and display not in THINKING_DISPLAYS:
        raise bad_request(f"thinking.display must be one of {', '.join(THINKING_DISPLAYS)}", param="thinking.display")
    return display


def _check_context_management(fields: Fields) -> None:
    management = fields.mapping("context_management")
    if management is None:
        return
    for n, edit in enumerate(management.array("edits") or []):
        if not isinstance(edit, dict) or not isinstance(edit.get("type"), str):
            where = f"context_management.edits[{n}]"
            raise bad_request(f"{where} must be an object with a type", param=where)


def _response_format(config: Fields | None) -> dict[str, Any] | None:
    output_format = config.mapping("format") if config is not None else None
    if output_format is None:
        return None
    if output_format.raw("type") != "json_schema" or not isinstance(output_format.raw("schema"), dict):
        raise bad_request(
            'output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config.format"
        )
    return {"type": "json_schema", "json_schema": {"schema": output_format.raw("schema")}}


def _conversation(fields: Fields, service: Service, hidden: HiddenThinking) -> Conversation:
    model = service.models.resolve(fields.text("model"))
    images = service.images()
    messages = anthropic_messages(fields.array("messages"), system_text(fields), images, hidden)
    tools = anthropic_tools(fields)
    config = fields.mapping("output_config")
    effort = effort_value(config, "effort") if config is not None else None
    thinking = service.thinking(
        model,
        thinking_switch(fields, "thinking"),
        effort or effort_value(fields, "reasoning_effort"),
        think_level_value(fields),
    )
    display = _thinking_display(fields)
    _check_context_management(fields)
    return Conversation(model, messages, tools, thinking, _response_format(config), display != "omitted", images)


async def messages_endpoint(request: Request) -> Response:
    service: Service = request.app.state.service
    fields = await read_json_object(request)
    hidden = hidden_thinking(request)
    talk = _conversation(fields, service, hidden)
    knobs = Knobs(
        api="messages",
        param="messages",
        sampling=sampling_params(fields, talk.thinking, min_p=False, seed=False),
        max_tokens=fields.required("max_tokens", output_budget(fields, "max_tokens")),  # validation.py
        stop=stop_strings(fields, "stop_sequences"),
        tool_id_prefix="toolu_",
        body=fields.body,
    )
    stream = bool(fields.flag("stream"))  # every field is read before the job exists, so a 400 leaves none
    await talk.images.check()
    job = await service.submit_chat(
        talk.messages,
        tools=talk.tools,
        thinking=talk.thinking,
        knobs=knobs,
        response_format=talk.response_format,
        images=talk.images,
    )
    message_id = new_id("msg_")

    def writer() -> MessageStream:
        return MessageStream(message_id, talk.model, hidden=None if talk.show_thinking else hidden)

    def body(done: Finished) -> dict[str, Any]:
        if not talk.show_thinking and done.completion.reasoning:
            hidden.remember(message_id, done.completion.reasoning)
        return message_object(message_id, talk.model, done, show_thinking=talk.show_thinking)

    return await respond(job, request, stream, writer, body)


async def count_tokens(request: Request) -> Response:
    service: Service = request.app.state.service
    fields = await read_json_object(request)
    talk = _conversation(fields, service, hidden_thinking(request))
    await talk.images.check()
    count = await service.count_chat_tokens(talk.messages, tools=talk.tools, thinking=talk.thinking, images=talk.images)
    return json_response({"input_tokens": count})


def usage_object(usage: Usage, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": 0,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": usage.prefilled_tokens,
    }


def message_object(message_id: str, model: str, done: Finished, *, show_thinking: bool = True) -> dict[str, Any]:
    completion = done.completion
    content: list[dict[str, Any]] = []
    if completion.reasoning:
        thinking = completion.reasoning if show_thinking else ""
        content.append({"type": "thinking", "thinking": thinking, "signature": message_id})
    if done.content or not completion.tool_calls:
        content.append({"type": "text", "text": done.content})
    for call, call_id in zip(completion.tool_calls, done.tool_ids, strict=True):
        content.append({"type": "tool_use", "id": call_id, "name": call.name, "input": call.arguments})
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        **stop_fields(done),
        "usage": usage_object(done.usage, done.usage.completion_tokens),
    }


def stop_fields(done: Finished) -> dict[str, Any]:
    """`stop_reason`, `stop_sequence` and `stop_details` (an invalid tool call's, else null)."""
    why = done.invalid_tool_call
    return {
        "stop_reason": "stop_sequence" if done.stop_sequence else STOP_REASONS[done.reason],
        "stop_sequence": done.stop_sequence,
        "stop_details": None if why is None else {"type": "invalid_tool_call", "explanation": why},
    }


class MessageStream:
    """Turns job events into Anthropic's `message_start … message_stop` SSE events."""

    def __init__(self, message_id: str, model: str, *, hidden: HiddenThinking | None = None) -> None:
        """`hidden`: thinking display "omitted", the reasoning goes there instead of to the client."""
        self.id, self.model, self.hidden = message_id, model, hidden
        self.index = -1
        self.open: str | None = None  # type of the block being streamed
        self.saw_text = self.saw_tool = False

    @staticmethod
    def _event(name: str, **body: Any) -> bytes:
        return sse({"type": name, **body}, name)

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [self._event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[bytes]:
        out = []
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": self.id}
            out.append(self._event("content_block_delta", index=self.index, delta=delta))
        if self.open is not None:
            out.append(self._event("content_block_stop", index=self.index))
        self.open = None
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self._event("content_block_delta", index=self.index, delta=delta)

    def __call__(self, event: Event) -> list[bytes]:
        if isinstance(event, Started):
            message = {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "stop_details": None,
                "usage": usage_object(event.usage, 0),
            }
            return [self._event("message_start", message=message)]
        if isinstance(event, ReasoningDelta):
            out = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
            if self.hidden is not None:  # the block and its signature, not the text
                return out
            return out + [self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, ContentDelta):
            self.saw_text = True
            out = [] if self.open == "text" else self._start({"type": "text", "text": ""})
            return out + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ToolCallOpened):
            self.saw_tool = True
            return self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ToolArgumentsDelta):
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        if isinstance(event, Finished):
            if self.hidden is not None and event.completion.reasoning:
                self.hidden.remember(self.id, event.completion.reasoning)
            out = self._close()
            if not self.saw_text and not self.saw_tool:
                out += self._start({"type": "text", "text": ""}) + self._close()
            usage = {"output_tokens": event.usage.completion_tokens}
            out.append(self._event("message_delta", delta=stop_fields(event), usage=usage))
            return out + [self._event("message_stop")]
        if isinstance(event, Failed):
            return [sse(error_body(ApiError(500, event.message), Dialect.ANTHROPIC), "error")]
        return []
