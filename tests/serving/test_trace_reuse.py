"""dwarfstar/serving/trace_reuse.py: the per-turn reuse table of a client's trace, and a miss traced
back to the client block that moved it. The request bodies are written here in the three APIs'
shapes (no client's own text); the chat prompts are rendered by the server's renderer."""

from __future__ import annotations

from dwarfstar.prompt.render import render_conversation
from dwarfstar.serving.request_trace import divergence
from dwarfstar.serving.trace_reuse import (
    conversation,
    explain,
    label,
    locate,
    reuse_rows,
    rewrite_cost,
)

ENV = "You are an agent.\n# Environment\n<env>\n  Working directory: /w\n  Today's date: {date}\n</env>\nBe brief."
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {}}}]


def chat_body(date: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": ENV.format(date=date)}]
    for n, text in enumerate(turns):
        messages.append({"role": "user" if n % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages, "tools": TOOLS, "stream": True}


def record(body: dict, previous: str | None = None, **figures: int) -> dict:
    prompt = render_conversation(body["messages"], tools=body.get("tools")).text
    found = {"request": body, "prompt": prompt, "completion_tokens": 0, "finish": "stop", **figures}
    if previous is not None and (where := divergence(previous, prompt)) is not None:
        found["divergence"] = where
    return found


def figures(
    prompt: int, cached: int, completion: int = 0, finish: str = "stop", tools: bool = True, replayed: int = 0
) -> dict:
    body = {"tools": TOOLS} if tools else {}
    return {
        "request": body,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_tokens": prompt - cached,
        "replayed_tokens": replayed,
        "completion_tokens": completion,
        "finish": finish,
    }


def test_a_new_date_in_the_system_message_is_named_as_the_date_line_of_messages_0():
    first = record(chat_body("Thu Dec 03 2026", "Hello!"))
    second = record(chat_body("Fri Dec 04 2026", "Hello!", "Hi.", "Thanks!"), previous=first["prompt"] + "Hi.")
    second.update(cached_tokens=40, prompt_tokens=90, prefilled_tokens=50)
    miss = explain(second)
    assert miss["block"] == "messages[0]" and miss["kind"] == "system" and miss["part"] == "messages[0].content"
    assert miss["label"] == "date line"
    assert miss["token"] == 40
    assert second["prompt"][miss["char"] :].startswith("Fri Dec 04")
    assert miss["was"].startswith("Thu Dec 03") and miss["now"].startswith("Fri Dec 04")


def test_a_conversation_that_only_grew_has_no_miss():
    first = record(chat_body("Thu Dec 03 2026", "Hello!"))
    second = record(chat_body("Thu Dec 03 2026", "Hello!", "Hi.", "Thanks!"), previous=first["prompt"] + "Hi.")
    assert "divergence" not in second and explain(second) is None


def test_a_changed_line_is_named_by_the_headings_above_it_and_its_key():
    text = "<reminder>\n# gitStatus\nCurrent branch: main\n\nRecent commits:\nabc1234 Second\nfff0000 First\n"
    assert label(text, text.index("abc1234") + 1) == "gitStatus › Recent commits"
    assert label(text, text.index("main")) == "gitStatus › Current branch"
    assert label(ENV, ENV.index("/w")) == "Environment › env › Working directory"
    assert label("Plain words here and more words after", 5) == "Plain words here and more words"


def test_an_anthropic_body_locates_its_system_entry_inside_messages():
    status = "<reminder>\n# gitStatus\nRecent commits:\nabc1234 Second\n</reminder>"
    body = {
        "system": [{"type": "text", "text": "You are a coding agent, answer briefly."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": status}, {"type": "text", "text": "Hello!"}]},
            {"role": "system", "content": [{"type": "text", "text": "Working directory: /w"}]},
        ],
        "tools": [{"name": "Read", "description": "Read a file.", "input_schema": {"type": "object"}}],
    }
    prompt = "<BOS>## Tools\nRead a file.\nYou are a coding agent, answer briefly.<User>" + status + "\n\nHello!"
    prompt += "\n\nWorking directory: /w<Assistant>"
    found = locate(prompt, prompt.index("abc1234") + 2, body)
    assert found["block"] == "messages[0]" and found["kind"] == "user"
    assert found["part"] == "messages[0].content[0].text"
    assert found["label"] == "gitStatus › Recent commits"
    assert locate(prompt, prompt.index("Read a file."), body)["block"] == "tools[0]"
    assert locate(prompt, prompt.index("<User>"), body) is None  # the template's own text


def test_the_nth_occurrence_of_a_repeated_text_is_the_nth_leaf_holding_it():
    body = {"input": [{"type": "message", "role": "user", "content": "Hello again"}] * 2}
    prompt = "<User>Hello again<Assistant>Hi<User>Hello again<Assistant>"
    assert locate(prompt, prompt.rindex("again"), body)["block"] == "input[1]"
    assert locate(prompt, prompt.index("again"), body)["block"] == "input[0]"


def test_a_miss_in_template_text_names_the_leaves_on_either_side():
    body = chat_body("Thu Dec 03 2026", "Hello!")
    prompt = render_conversation(body["messages"], tools=body["tools"]).text
    at = prompt.index("Hello!") - 1  # the user marker before the text
    rec = {"request": body, "prompt": prompt, "cached_tokens": 0, "divergence": divergence(prompt, prompt[:at] + "X")}
    miss = explain(rec)
    assert "block" not in miss and miss["token"] is None
    # this layout renders the tools after the system text, then the turns
    assert miss["between"] == {"before": "tools[0].function.description", "after": "messages[1].content"}


def test_side_requests_without_tools_are_not_the_conversation():
    title = figures(500, 0, tools=False)
    main = figures(7000, 0)
    assert conversation([title, main]) == [main]
    assert conversation([title]) == [title]


def test_the_reuse_rows_count_new_reprefilled_and_replayed_tokens():
    turn1 = [figures(500, 0, 10, tools=False), figures(7000, 0, 12)]
    turn2 = [figures(7020, 7011, 60, finish="tool_calls"), figures(7150, 7110, 20)]
    rewritten = figures(7200, 4200, 8, replayed=104)
    rewritten["divergence"] = {"offset": 100, "common": "", "before": "old", "after": "new"}
    rows = reuse_rows([turn1, turn2, [rewritten]])
    assert [(r["turn"], r["request"]) for r in rows] == [(1, 1), (2, 1), (2, 2), (3, 1)]
    first, call, answer, third = rows
    assert (first["new"], first["reprefilled"], first["replayed"], first["miss"]) == (7000, 0, 0, None)
    assert (call["new"], call["prefilled"], call["reprefilled"]) == (8, 9, 1)  # 7020 - (7000 + 12)
    assert (answer["new"], answer["reprefilled"], answer["ratio"]) == (70, 0, round(7110 / 7150, 4))
    assert (third["new"], third["prefilled"], third["reprefilled"], third["replayed"]) == (30, 3000, 2970, 104)
    assert third["miss"]["char"] == 100 and third["miss"]["token"] == 4200


def test_a_rewrite_costs_the_changed_sessions_prefill_beyond_the_unchanged_ones():
    changed, unchanged = figures(11700, 9000, replayed=808), figures(11700, 11000)
    changed["divergence"] = {"offset": 40000, "common": "", "before": "abc", "after": "def"}
    rows = rewrite_cost(changed, unchanged)
    assert [r["turn"] for r in rows] == ["new*", "new"]
    assert (rows[0]["prefilled"], rows[0]["new"], rows[0]["reprefilled"], rows[0]["replayed"]) == (2700, 700, 2000, 808)
    assert (rows[1]["prefilled"], rows[1]["new"], rows[1]["reprefilled"]) == (700, 700, 0)
