"""The stress test's clients (`stress.py`): one request body per API, sent streamed or not, the reply
read back into one comparable shape, and the conversation continued in the API's own message shape.

Raw HTTP (httpx), not the SDKs: a stream can be left after any number of events, and a request is
sent again byte for byte when it runs alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx

from dwarfstar.train.chat_data import TOOLS

MODEL = "deepseek-v4-flash"
APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass
class Reply:
    """What a request got back: its text, its tool calls (name, arguments as canonical JSON), how it
    ended (the API's own finish field) or the error it ended with. `turn` is the assistant's part in
    the API's message shape (with the call ids), to continue the conversation with."""

    text: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    turn: Any = None
    call_ids: list[str] = field(default_factory=list)

    def key(self) -> tuple:
        """What two runs of one greedy request must share (call ids are drawn at random)."""
        return self.text, tuple(self.calls), self.finish, self.error


def canonical(arguments: str | dict) -> str:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return f"<not JSON> {arguments}"
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


# -- request bodies ---------------------------------------------------------------------------------------
def first_body(api: str, system: str | None, user: str, tools: bool, max_tokens: int) -> dict[str, Any]:
    """A new conversation, greedy, thinking off."""
    if api == "chat":
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        body = {"messages": messages, "max_tokens": max_tokens, "thinking": {"type": "disabled"}}
    elif api == "responses":
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}]
        body = {"input": items, "max_output_tokens": max_tokens, "reasoning": {"effort": "none"}}
        if system:
            body["instructions"] = system
    else:
        body = {"messages": [{"role": "user", "content": user}], "max_tokens": max_tokens}
        body["thinking"] = {"type": "disabled"}
        if system:
            body["system"] = system
    if tools:
        body["tools"] = TOOLS[api]
    return {"model": MODEL, "temperature": 0, **body}


def next_body(api: str, body: dict[str, Any], reply: Reply, user: str | None, result: str | None) -> dict[str, Any]:
    """`body`'s conversation continued by its reply, then a user turn (`user`) or each tool call's `result`."""
    body = json.loads(json.dumps(body))
    if api == "chat":
        body["messages"].append(reply.turn)
        if result is not None:
            body["messages"] += [{"role": "tool", "tool_call_id": i, "content": result} for i in reply.call_ids]
        else:
            body["messages"].append({"role": "user", "content": user})
    elif api == "responses":
        body["input"] += reply.turn
        if result is not None:
            body["input"] += [{"type": "function_call_output", "call_id": i, "output": result} for i in reply.call_ids]
        else:
            body["input"].append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]})
    else:
        body["messages"].append({"role": "assistant", "content": reply.turn})
        if result is not None:
            results = [{"type": "tool_result", "tool_use_id": i, "content": result} for i in reply.call_ids]
            body["messages"].append({"role": "user", "content": results})
        else:
            body["messages"].append({"role": "user", "content": user})
    return body


# -- sending -------------------------------------------------------------------------------------------
def send(client: httpx.Client, api: str, body: dict[str, Any], stream: bool, cut: int | None = None) -> Reply | None:
    """The request's reply; None for a stream left after `cut` events (the client walks away)."""
    body = {**body, "stream": stream}
    if not stream:
        response = client.post(PATHS[api], json=body)
        data = response.json()
        if response.status_code != 200:
            return Reply(error=f"{response.status_code} {error_message(data)}")
        return READERS[api](data)
    events = []
    with client.stream("POST", PATHS[api], json=body) as response:
        if response.status_code != 200:
            response.read()
            return Reply(error=f"{response.status_code} {error_message(response.json())}")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                events.append((name, json.loads(line[6:])))
                name = None
                if cut is not None and len(events) >= cut:
                    return None
    return STREAM_READERS[api](events)


def error_message(data: Any) -> str:
    error = data.get("error") if isinstance(data, dict) else None
    return error.get("message", "") if isinstance(error, dict) else json.dumps(data)[:200]


# -- replies ----------------------------------------------------------------------------------------------
def chat_reply(data: dict[str, Any]) -> Reply:
    choice = data["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    turn = {"role": "assistant", "content": message.get("content") or ""}
    if calls:
        turn["tool_calls"] = calls
    return Reply(
        text=message.get("content") or "",
        calls=[(c["function"]["name"], canonical(c["function"]["arguments"])) for c in calls],
        finish=choice["finish_reason"],
        turn=turn,
        call_ids=[c["id"] for c in calls],
    )


def chat_stream(events: list[tuple[str | None, Any]]) -> Reply:
    text, calls, finish = [], {}, None
    for name, data in events:
        if name == "error" or "error" in data:
            return Reply(text="".join(text), error=error_message(data))
        for choice in data.get("choices", []):
            delta = choice.get("delta", {})
            text.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": "", "type": "function", "name": "", "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    tool_calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for _, c in sorted(calls.items())
    ]
    message = {"role": "assistant", "content": "".join(text), "tool_calls": tool_calls}
    return chat_reply({"choices": [{"message": message, "finish_reason": finish}]})


def responses_reply(data: dict[str, Any]) -> Reply:
    items = [item for item in data.get("output", []) if item.get("type") in ("message", "function_call")]
    text = "".join(
        part.get("text", "")
        for item in items
        if item["type"] == "message"
        for part in item.get("content", [])
        if part.get("type") == "output_text"
    )
    calls = [item for item in items if item["type"] == "function_call"]
    finish = data.get("status")
    if finish == "incomplete":
        finish += f" ({(data.get('incomplete_details') or {}).get('reason')})"
    return Reply(
        text=text,
        calls=[(c["name"], canonical(c["arguments"])) for c in calls],
        finish=finish,
        error=error_message(data) if data.get("error") else None,
        turn=items,
        call_ids=[c["call_id"] for c in calls],
    )


def responses_stream(events: list[tuple[str | None, Any]]) -> Reply:
    final = next((d for _, d in reversed(events) if d.get("type", "").startswith("response.") and "response" in d), {})
    reply = responses_reply(final.get("response", {}))
    errors = [d for name, d in events if name == "error" or d.get("type") == "error"]
    if errors:
        reply.error = errors[0].get("message") or error_message(errors[0])
    return reply


def messages_reply(data: dict[str, Any]) -> Reply:
    blocks = [b for b in data.get("content", []) if b.get("type") in ("text", "tool_use")]
    uses = [b for b in blocks if b["type"] == "tool_use"]
    return Reply(
        text="".join(b.get("text", "") for b in blocks if b["type"] == "text"),
        calls=[(b["name"], canonical(b["input"])) for b in uses],
        finish=data.get("stop_reason"),
        turn=blocks,
        call_ids=[b["id"] for b in uses],
    )


def messages_stream(events: list[tuple[str | None, Any]]) -> Reply:
    blocks: dict[int, dict[str, Any]] = {}
    stop = None
    for name, data in events:
        kind = data.get("type") or name
        if kind == "error":
            return Reply(text="".join(b.get("text", "") for b in blocks.values()), error=error_message(data))
        if kind == "content_block_start":
            blocks[data["index"]] = {**data["content_block"], "partial": ""}
        elif kind == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta.get("type") == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif delta.get("type") == "input_json_delta":
                block["partial"] += delta["partial_json"]
        elif kind == "message_delta":
            stop = data.get("delta", {}).get("stop_reason") or stop
    content = []
    for _, block in sorted(blocks.items()):
        partial = block.pop("partial")
        if block.get("type") == "tool_use":
            block["input"] = json.loads(partial) if partial else block.get("input", {})
        content.append(block)
    return messages_reply({"content": content, "stop_reason": stop})


READERS = {"chat": chat_reply, "responses": responses_reply, "messages": messages_reply}
STREAM_READERS = {"chat": chat_stream, "responses": responses_stream, "messages": messages_stream}
