"""What a `--trace` file says about prefix reuse over a client's turns (tools/clients_check.py).

Per turn, each request of the client's conversation: prompt, cached (reused) and prefilled tokens,
the turn's new tokens, and, where the prompt stopped extending the conversation, which block of the
client's request moved it. The trace's `divergence` offset is a character of the rendered prompt;
the text leaves of the request body are looked up in that prompt, and the leaf that covers the offset
names the block (`system[2]`, `messages[0]`, `input[3]`...) and, from the lines around the offset, a
short label: "date line", or the section and key the changed line sits under ("gitStatus › Recent
commits", "env › Working directory").
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
DATE = re.compile(rf"\b(19|20)\d\d-\d\d-\d\d\b|\b(Mon|Tue|Wed|Thu|Fri|Sat|Sun)\w* ({MONTHS})\w* \d")
KEY = re.compile(r"^\s*(?:[-*]\s+)?([A-Za-z][\w .'/()-]{0,40}?):(\s|$)")
TAG = re.compile(r"^\s*<([\w-]+)>")
SEARCHED = 4  # leaves shorter than this are not looked up (a "user" or "text" is everywhere)


def conversation(records: list[dict]) -> list[dict]:
    """The requests that carry the agent's conversation: those offering tools (a client's side
    requests, a title say, offer none); all of them when none does."""
    main = [r for r in records if (r.get("request") or {}).get("tools")]
    return main or records


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string in a request body, with its path (`messages[1].content[0].text`)."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")


def block_of(body: dict, path: str) -> dict[str, str]:
    """The top-level block a leaf belongs to (`messages[3]`), and its role or item type."""
    top = re.match(r"[^.\[]+(\[\d+\])?", path).group(0)
    index = re.search(r"\[(\d+)\]", top)
    item = body.get(top.split("[")[0])
    entry = item[int(index.group(1))] if index and isinstance(item, list) else None
    kind = ""
    if isinstance(entry, dict):
        kind = "/".join(str(entry[k]) for k in ("type", "role", "name") if isinstance(entry.get(k), str))
    return {"block": top, "kind": kind, "part": path}


def locate(prompt: str, offset: int, body: dict) -> dict[str, Any] | None:
    """The request body's leaf whose rendered text covers character `offset` of `prompt`: the
    longest one (a short string may turn up inside a long one by chance); an n-th occurrence of a
    text that several leaves hold is the n-th of those leaves. None when no leaf covers it (the
    template's own text): then `between` names the leaves on either side."""
    same: dict[str, list[str]] = {}
    for path, text in leaves(body):
        if len(text) >= SEARCHED:
            same.setdefault(text, []).append(path)
    best = None
    for text, paths in same.items():
        start = prompt.find(text, max(0, offset - len(text) + 1), offset + len(text))
        if start == -1 or start > offset or (best is not None and len(text) <= len(best[0])):
            continue
        nth = prompt.count(text, 0, start) if len(paths) > 1 else 0
        best = (text, paths[min(nth, len(paths) - 1)], start)
    if best is None:
        return None
    text, path, start = best
    return {**block_of(body, path), "at": offset - start, "label": label(text, offset - start)}


def neighbours(prompt: str, offset: int, body: dict) -> dict[str, str | None]:
    """The leaves that end last before `offset` and start first after it (for a miss in template text)."""
    before, after = (-1, None), (len(prompt) + 1, None)
    for path, text in leaves(body):
        if len(text) < SEARCHED:
            continue
        end = prompt.rfind(text, 0, offset)
        if end != -1 and end + len(text) <= offset and end + len(text) > before[0]:
            before = (end + len(text), path)
        start = prompt.find(text, offset)
        if start != -1 and start < after[0]:
            after = (start, path)
    return {"before": before[1], "after": after[1]}


def label(text: str, at: int) -> str:
    """A short name for what sits at character `at` of a block's text: "date line", or the headings
    above the changed line (a markdown `#` heading, a short `Name:` line, a lone `<tag>`) and the
    line's own key; else the line's first words."""
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    line = text[start : end if end != -1 else len(text)]
    if DATE.search(line):
        return "date line"
    heading, subheading = None, None
    for above in reversed(text[:start].splitlines()[-40:]):
        stripped = above.strip()
        if heading is None and stripped.startswith("#"):
            heading = stripped.lstrip("#").strip()[:40]
        elif subheading is None and heading is None and stripped.endswith(":") and len(stripped) < 40:
            subheading = stripped[:-1]
        elif subheading is None and heading is None and (tag := TAG.fullmatch(stripped)):
            subheading = tag.group(1)
    key = KEY.match(line) or TAG.match(line)
    named = [part for part in (heading, subheading, key.group(1).strip() if key else None) if part]
    return " › ".join(named) if named else " ".join(line.split()[:6])


def explain(record: dict) -> dict[str, Any] | None:
    """A trace record's miss: where its prompt stopped extending the closest earlier conversation
    (character and, when any was reused, token), the client block there, and the text either side."""
    where = record.get("divergence")
    if where is None:
        return None
    found = {
        "char": where["offset"],
        "token": record["cached_tokens"] or None,  # the reused prefix ends where the bytes part
        "was": where["before"][:80],
        "now": where["after"][:80],
    }
    body, prompt = record.get("request"), record.get("prompt")
    if isinstance(body, dict) and isinstance(prompt, str):
        found.update(locate(prompt, where["offset"], body) or {"between": neighbours(prompt, where["offset"], body)})
    return found


def reuse_row(record: dict, previous: dict | None) -> dict[str, Any]:
    """One request's figures. `new`: what the conversation grew by since `previous` (its prompt and
    answer), all of the prompt without one; `reprefilled`: prefilled beyond that; `replayed`: tokens
    the server recomputed from its nearest checkpoint to cut a cached state back to the shared prefix
    (not counted as prefilled)."""
    prompt, cached, prefilled = record["prompt_tokens"], record["cached_tokens"], record["prefilled_tokens"]
    grown = prompt - previous["prompt_tokens"] - previous["completion_tokens"] if previous else prompt
    new = max(0, min(prompt, grown))
    miss = explain(record)
    return {
        "prompt": prompt,
        "cached": cached,
        "prefilled": prefilled,
        "ratio": round(cached / prompt, 4) if prompt else 0.0,
        "new": new,
        "reprefilled": max(0, prefilled - new),
        "replayed": record.get("replayed_tokens", 0),
        "finish": record["finish"],
        "miss": miss,
    }


def reuse_rows(turns: list[list[dict]]) -> list[dict]:
    """Per turn (a list of trace records each), a row for each request of the conversation."""
    rows, previous = [], None
    for n, records in enumerate(turns, 1):
        for j, record in enumerate(conversation(records), 1):
            rows.append({"turn": n, "request": j, **reuse_row(record, previous)})
            previous = record
    return rows


def describe_miss(miss: dict | None) -> str:
    if miss is None:
        return ""
    token = f"token {miss['token']}, " if miss.get("token") else ""
    if "block" in miss:
        kind = f" ({miss['kind']})" if miss["kind"] else ""
        return f"{token}char {miss['char']}: {miss['block']}{kind} {miss['part']}: {miss['label']}"
    between = miss.get("between") or {}
    return f"{token}char {miss['char']}: template text between {between.get('before')} and {between.get('after')}"


def print_reuse(rows: list[dict], indent: str = "") -> None:
    print(f"{indent}turn req  prompt  cached  prefill  ratio   new  re-prefill  replay  miss")
    for row in rows:
        print(
            f"{indent}{row['turn']!s:>4} {row['request']:>3} {row['prompt']:>7} {row['cached']:>7}"
            f" {row['prefilled']:>8} {row['ratio']:>6.3f} {row['new']:>5} {row['reprefilled']:>11} {row['replayed']:>7}"
            f"  {describe_miss(row['miss'])}"
        )
        if row["miss"]:
            print(f"{indent}{'':>9}was {row['miss']['was'][:60]!r}\n{indent}{'':>9}now {row['miss']['now'][:60]!r}")


def rewrite_cost(changed: dict, unchanged: dict) -> list[dict]:
    """Rows for two new sessions of a client in one workspace: `changed` after a change to what the
    client puts in its early blocks (a commit), `unchanged` after it with nothing changed but the
    user's text. The unchanged one's prefill is a new session's own new tokens; the changed one's
    beyond that is what the rewrite cost."""
    baseline = reuse_row(unchanged, None)
    row = reuse_row(changed, None)
    row.update(new=baseline["prefilled"], reprefilled=max(0, row["prefilled"] - baseline["prefilled"]))
    baseline.update(new=baseline["prefilled"], reprefilled=0)
    return [{"turn": "new*", "request": 1, **row}, {"turn": "new", "request": 1, **baseline}]
