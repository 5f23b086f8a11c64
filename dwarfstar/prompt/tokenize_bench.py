"""Tokenizer and prompt benchmark: encode speed against HF `tokenizers` on the official tokenizer.json,
and the cost of rendering plus tokenizing a long agent conversation."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from dwarfstar.prompt.render import Prompt, render_conversation
from dwarfstar.tokenizer.tokenizer import Tokenizer

AGENT_MESSAGES = 100


@dataclass(frozen=True, slots=True)
class BenchResult:
    text_bytes: int
    tokens: int
    ids_match: bool
    ours_mb_s: float
    official_mb_s: float
    agent_messages: int
    agent_tokens: int
    render_ms: float
    tokenize_ms: float

    @property
    def ratio(self) -> float:
        return self.ours_mb_s / self.official_mb_s


def best_seconds(work: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def agent_conversation(text: str, messages: int = AGENT_MESSAGES) -> dict[str, Any]:
    """A coding-agent transcript: system, a task, then rounds of reasoning, tool call and tool output.

    Tool outputs are successive 1.5 kB slices of `text`, so the conversation is long (about 80 kB)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name} tool of the benchmark agent",
                "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
            },
        }
        for name in ("bash", "read", "edit")
    ]
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Work step by step."},
        {"role": "user", "content": "Summarise the novel chapter by chapter."},
    ]
    for n in range((messages - 4) // 2):
        call = {
            "id": f"call_{n}",
            "type": "function",
            "function": {"name": "read", "arguments": json.dumps({"arg": f"chapter_{n}.txt", "limit": 200})},
        }
        conversation.append(
            {"role": "assistant", "content": "", "reasoning_content": f"Read part {n}.", "tool_calls": [call]}
        )
        conversation.append({"role": "tool", "tool_call_id": f"call_{n}", "content": text[n * 1500 : (n + 1) * 1500]})
    conversation.append({"role": "assistant", "content": "I have read every part.", "reasoning_content": "Done."})
    conversation.append({"role": "user", "content": "Now write the summary."})
    return {"messages": conversation, "tools": tools}


def run_bench(tokenizer: Tokenizer, official_json: Path, text: str, repeats: int = 3) -> BenchResult:
    official = HFTokenizer.from_file(str(official_json))
    ours_ids = tokenizer.encode(text)
    official_ids = official.encode(text, add_special_tokens=False).ids
    ours_s = best_seconds(lambda: tokenizer.encode(text), repeats)
    official_s = best_seconds(lambda: official.encode(text, add_special_tokens=False), repeats)
    megabytes = len(text.encode("utf-8")) / 1e6

    request = agent_conversation(text)

    def render() -> Prompt:
        return render_conversation(request["messages"], tools=request["tools"], thinking=True)

    prompt = render()
    render_s = best_seconds(render, repeats * 3)
    tokenize_s = best_seconds(lambda: tokenizer.encode_prompt(prompt.parts), repeats * 3)
    return BenchResult(
        text_bytes=len(text.encode("utf-8")),
        tokens=len(ours_ids),
        ids_match=ours_ids == official_ids,
        ours_mb_s=megabytes / ours_s,
        official_mb_s=megabytes / official_s,
        agent_messages=len(request["messages"]),
        agent_tokens=len(tokenizer.encode_prompt(prompt.parts)),
        render_ms=render_s * 1000,
        tokenize_ms=tokenize_s * 1000,
    )
