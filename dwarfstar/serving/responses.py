"""`POST /v1/responses`: the OpenAI Responses API, as Codex uses it (stateless, full input replayed).

Input items (DS4_SURFACE §2.3): `message` (text blocks; images read by serving/images.py),
`function_call` (merged into the assistant turn right before it), `function_call_output`, and
`reasoning`, whose text goes to the next assistant turn. Only `function` tools are offered to the
model; hosted tool types are ignored. `previous_response_id` and `conversation` are refused: this
server keeps no response store.

Reasoning is shown as summary text when `reasoning.summary` asks for it (ds4's rule). It is also
returned in `encrypted_content` when `include` asks for that, as Codex does: the client sends it
back with the next request, so the replayed turn renders with its reasoning and the live KV, which
holds that reasoning, stays a prefix of the new prompt.

What Codex 0.171 sends (checked by `nox -s clients`): `model`, `input` (items `message` with roles
developer/user/assistant, `reasoning`, `function_call`, `function_call_output`), `tools`,
`tool_choice`, `reasoning`, `include`, `stream`, all used as above; `store`, `parallel_tool_calls`
(calls are always allowed in parallel), `prompt_cache_key` (prefix reuse needs no key: the cache
matches prompt bytes) and `client_metadata` are accepted and ignored.

An invalid tool call (a DSML block the parser gives up) yields no `function_call` item: its text, as
the model wrote it, follows the message's text, and the response is `incomplete` with
`incomplete_details: {"reason": "invalid_tool_call", "explanation": WHY}` (the budget's reason first
when the budget cut the block). Codex reads an incomplete response as an error and asks again.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from dwarfstar.prompt.dsml_parser import ContentDelta, ReasoningDelta, ToolArgumentsDelta, ToolCallEnd
from dwarfstar.serving.controls import (
    Thinking,
    effort_value,
    output_budget,
    sampling_params,
    structured_format,
    think_level_value,
)
from dwarfstar.serving.errors import bad_request
from dwarfstar.serving.fields import Fields, read_json_object
from dwarfstar.serving.generation import Event, Failed, Finished, Started, TokenLogprob, ToolCallOpened, Usage, new_id
from dwarfstar.serving.images import Images
from dwarfstar.serving.logprobs import Pending, openai_entry, responses_logprobs
from dwarfstar.serving.service import Knobs, Service
from dwarfstar.serving.sse import respond, sse
from dwarfstar.serving.validation import check_tool_choice, media_refused, non_empty, unknown_role, unsupported_part

# an unfinished output's reason: the budget, or the loop guard's `repetition` (the trace has the detail)
INCOMPLETE = {"length": "max_output_tokens", "repetition": "repetition"}
TEXT_BLOCKS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
MEDIA_BLOCKS = ("input_image", "input_file", "input_audio")
ROLES = ("user", "system", "developer", "assistant")
SUMMARY_MODES = ("auto", "concise", "detailed")
ENCRYPTED_PREFIX = "dwarfstar:"


def _blocks_text(content: Any, where: str, images: Images, *, tool: bool = False) -> str:
    """Text blocks joined; an image read into `images`, its slot in its place (serving/images.py), files
    and audio refused, or in a tool output (`tool`) written as `[Unsupported TYPE]` (validation.py,
    `media`); a `refusal` dropped."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of content blocks", f"{where}.content")
    texts = []
    for m, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in TEXT_BLOCKS and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "input_image":
            texts.append(images.read(block, kind, f"{where}.content[{m}]", tool=tool))
        elif kind in MEDIA_BLOCKS and tool:
            texts.append(unsupported_part(kind))
        elif kind in MEDIA_BLOCKS:
            raise media_refused(kind, f"{where}.content[{m}]")
        elif kind != "refusal":
            raise bad_request(f"{where}.content[{m}]: unsupported content block type {kind!r}", f"{where}.content")
    return "".join(texts)


def seal_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def _reasoning_text(item: dict[str, Any]) -> str:
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str) and sealed.startswith(ENCRYPTED_PREFIX):
        try:
            return base64.b64decode(sealed[len(ENCRYPTED_PREFIX) :], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            pass  # not ours after all: fall back to the visible text
    parts = [*(item.get("summary") or []), *(item.get("content") or [])]
    return "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def input_messages(fields: Fields, images: Images) -> list[dict[str, Any]]:
    items = fields.required("input", fields.raw("input"))
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("input must be a string or an array of items", param="input")
    non_empty(items, "input")
    instructions = fields.text("instructions")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: str | None = None
    for n, item in enumerate(items):
        where = f"input[{n}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise unknown_role(role, where, ROLES)
            text = _blocks_text(item.get("content"), where, images)
            if role == "assistant":
                messages.append({"role": "assistant", "content": text, "reasoning_content": reasoning})
                reasoning = None
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str | dict):
                raise bad_request(f"{where}: a function_call needs a name and arguments", param=where)
            call = {"id": item.get("call_id") or "", "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item.get("arguments") or "{}"}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(
                    {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [call]}
                )
                reasoning = None
        elif kind == "function_call_output":
            output = _blocks_text(item.get("output"), where, images, tool=True)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "", "content": output})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
    return messages


def function_tools(fields: Fields) -> list[dict[str, Any]]:
    tools = fields.array("tools") or []
    offered = []
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{n}] must be an object", param=f"tools[{n}]")
        if tool.get("type") != "function":
            continue  # hosted tools (web_search, ...) run nowhere here
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{n}] needs a name", param=f"tools[{n}].name")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise bad_request(f"tools[{n}].parameters must be an object", param=f"tools[{n}].parameters")
        offered.append(tool)
    choice = fields.raw("tool_choice")
    names = [tool["name"] for tool in offered]
    check_tool_choice(choice, names, named=None, needs_tools=isinstance(choice, dict) or choice == "required")
    if isinstance(choice, dict):
        raise bad_request("forced tool_choice not supported", param="tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad_request(f"tool_choice={choice} not supported", param="tool_choice")
    return [] if choice == "none" else offered


async def responses_endpoint(request: Request) -> Response:
    service: Service = request.app.state.service
    fields = await read_json_object(request)
    model = service.models.resolve(fields.text("model"))
    for key in ("previous_response_id", "conversation"):
        if fields.has(key):
            raise bad_request(f"{key} is not supported; replay full input instead", param=key)
    images = service.images()
    messages = input_messages(fields, images)
    tools = function_tools(fields)
    reasoning = fields.mapping("reasoning") or Fields({}, "reasoning.")
    thinking = service.thinking(model, None, effort_value(reasoning, "effort"), think_level_value(fields))
    knobs = Knobs(
        api="responses",
        param="input",
        sampling=replace(
            sampling_params(fields, thinking, top_k=False, min_p=False, seed=False),
            logprobs=responses_logprobs(fields),
        ),
        max_tokens=output_budget(fields, "max_output_tokens", "max_tokens"),
        body=fields.body,
    )
    shape = ResponseShape(
        id=new_id("resp_"),
        model=model,
        summary=reasoning.text("summary") in SUMMARY_MODES,
        sealed="reasoning.encrypted_content" in (fields.array("include") or []),
        thinking=thinking,
        echo={key: fields.raw(key) for key in ("instructions", "tool_choice", "temperature", "top_p")}
        | {"tools": fields.raw("tools") or []},  # as sent: hosted tools too, though only functions run
    )
    stream = bool(fields.flag("stream"))  # every field is read before the job exists, so a 400 leaves none
    await images.check()
    job = await service.submit_chat(
        messages,
        tools=tools,
        thinking=thinking,
        knobs=knobs,
        response_format=structured_format(fields.mapping("text"), "format"),
        images=images,
    )
    return await respond(
        job,
        request,
        stream,
        lambda: ResponseStream(shape),
        lambda done: shape.response(_final_items(shape, done), done),
    )


# -- output items -----------------------------------------------------------------------------------------
def reasoning_item(item_id: str, text: str, shape: ResponseShape, status: str) -> dict[str, Any]:
    item: dict[str, Any] = {"id": item_id, "type": "reasoning", "status": status, "summary": []}
    if shape.summary and text:
        item["summary"] = [{"type": "summary_text", "text": text}]
    if shape.sealed:
        item["encrypted_content"] = seal_reasoning(text)
    return item


def message_item(
    item_id: str, text: str, status: str, logprobs: Sequence[TokenLogprob] | None = None
) -> dict[str, Any]:
    """`logprobs`: the entries of the response's tokens so far (serving/logprobs.py), when asked."""
    entries = [openai_entry(e) for e in logprobs or ()]
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": entries}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def _final_items(shape: ResponseShape, done: Finished) -> list[dict[str, Any]]:
    completion = done.completion
    items = []
    if shape.shows_reasoning and completion.reasoning:
        items.append(reasoning_item(new_id("rs_"), completion.reasoning, shape, "completed"))
    if done.content or not completion.tool_calls:
        items.append(message_item(new_id("msg_"), done.content, "completed", done.logprobs))
    for call, call_id in zip(completion.tool_calls, done.tool_ids, strict=True):
        items.append(call_item(new_id("fc_"), call_id, call.name, call.arguments_json, "completed"))
    return items


class ResponseShape:
    """What one response looks like: its id, which reasoning it shows, the request fields it echoes."""

    def __init__(
        self, *, id: str, model: str, summary: bool, sealed: bool, thinking: Thinking, echo: dict[str, Any]
    ) -> None:
        self.id, self.model, self.summary, self.sealed, self.echo = id, model, summary, sealed, echo
        self.shows_reasoning = thinking.enabled and (summary or sealed)
        self.created = int(time.time())

    def response(self, output: list[dict[str, Any]], done: Finished | Failed | None) -> dict[str, Any]:
        status = "in_progress"
        body: dict[str, Any] = {"error": None, "incomplete_details": None}
        if isinstance(done, Finished):
            body["incomplete_details"] = incomplete_details(done)
            status = "completed" if body["incomplete_details"] is None else "incomplete"
        elif isinstance(done, Failed):
            status = "failed"
            body["error"] = {"code": "server_error", "message": done.message}
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            **body,
            **self.echo,
            "parallel_tool_calls": True,
        }
        if done is not None:
            response["usage"] = usage_object(done.usage)
        return response


def incomplete_details(done: Finished) -> dict[str, Any] | None:
    """Why the output is incomplete: the budget or the loop guard, else an invalid tool call; None if it is not."""
    if done.reason in INCOMPLETE:
        return {"reason": INCOMPLETE[done.reason]}
    why = done.invalid_tool_call
    return None if why is None else {"reason": "invalid_tool_call", "explanation": why}


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.prefilled_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseStream:
    """Job events as Responses API events, each item opened, streamed and closed in output order."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # text of the open reasoning or message item
        self.logprobs: list[TokenLogprob] = []  # every token's so far, when the request asks
        self.pending = Pending()  # those not yet sent with a text delta

    def _event(self, kind: str, **body: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        return sse(event, kind)

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.open, self.text = item, ""
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        if item["type"] == "reasoning" and self.shape.summary:
            part = {"type": "summary_text", "text": ""}
            out.append(self._event("response.reasoning_summary_part.added", **self._at(), summary_index=0, part=part))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(self._event("response.content_part.added", **self._at(), content_index=0, part=part))
        return out

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _close(self) -> list[bytes]:
        item, out = self.open, []
        if item is None:
            return out
        if item["type"] == "reasoning":
            final = reasoning_item(item["id"], self.text, self.shape, "completed")
            if self.shape.summary:
                out.append(
                    self._event("response.reasoning_summary_text.done", **self._at(), summary_index=0, text=self.text)
                )
                part = {"type": "summary_text", "text": self.text}
                out.append(
                    self._event("response.reasoning_summary_part.done", **self._at(), summary_index=0, part=part)
                )
        elif item["type"] == "message":
            final = message_item(item["id"], self.text, "completed", self.logprobs)
            out.append(self._event("response.output_text.done", **self._at(), content_index=0, text=self.text))
            part = final["content"][0]
            out.append(self._event("response.content_part.done", **self._at(), content_index=0, part=part))
        else:
            final = {**item, "status": "completed"}
        self.output[-1] = final
        out.append(self._event("response.output_item.done", output_index=len(self.output) - 1, item=final))
        self.open = None
        return out

    def __call__(self, event: Event) -> list[bytes]:
        shape = self.shape
        if isinstance(event, Started):
            response = shape.response([], None)
            return [
                self._event("response.created", response=response),
                self._event("response.in_progress", response=response),
            ]
        if isinstance(event, TokenLogprob):
            self.logprobs.append(event)
            self.pending.entries.append(event)
            return []
        if isinstance(event, ReasoningDelta):
            if not shape.shows_reasoning:
                return []
            out = (
                []
                if self.open and self.open["type"] == "reasoning"
                else self._add(reasoning_item(new_id("rs_"), "", shape, "in_progress"))
            )
            self.text += event.text
            if shape.summary:
                out.append(
                    self._event(
                        "response.reasoning_summary_text.delta", **self._at(), summary_index=0, delta=event.text
                    )
                )
            return out
        if isinstance(event, ContentDelta):
            out = (
                []
                if self.open and self.open["type"] == "message"
                else self._add(message_item(new_id("msg_"), "", "in_progress"))
            )
            self.text += event.text
            logprobs = [openai_entry(e) for e in self.pending.take()]
            delta = self._event(
                "response.output_text.delta", **self._at(), content_index=0, delta=event.text, logprobs=logprobs
            )
            return out + [delta]
        if isinstance(event, ToolCallOpened):
            return self._add(call_item(new_id("fc_"), event.id, event.name, "", "in_progress"))
        if isinstance(event, ToolArgumentsDelta):
            return [self._event("response.function_call_arguments.delta", **self._at(), delta=event.text)]
        if isinstance(event, ToolCallEnd):
            self.open["arguments"] = event.call.arguments_json
            done = self._event(
                "response.function_call_arguments.done",
                **self._at(),
                arguments=event.call.arguments_json,
                name=event.call.name,
            )
            return [done, *self._close()]
        if isinstance(event, Finished):
            out = self._close()
            if not any(item["type"] in ("message", "function_call") for item in self.output):
                out += self._add(message_item(new_id("msg_"), "", "in_progress")) + self._close()
            kind = "response.completed" if incomplete_details(event) is None else "response.incomplete"
            return out + [self._event(kind, response=shape.response(self.output, event))]
        if isinstance(event, Failed):
            error = self._event("error", code="server_error", message=event.message, param=None)
            return [error, self._event("response.failed", response=shape.response(self.output, event))]
        return []
