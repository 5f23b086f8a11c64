"""Random text for agent_prompts.py from the phrase bank (agent_phrases.py): sections of instructions,
tool declarations with their JSON schemas in each client's shape, and the environment blocks (working
directory, git state, date, platform, model) a coding agent sends."""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dwarfstar.train.agent_phrases import PHRASES

TOOL_COUNT = (10, 20)
LANGUAGES = (  # (language, file extension, test commands)
    ("Python", "py", ("pytest -q", "make test", "tox -e py", "uv run pytest")),
    ("TypeScript", "ts", ("npm test", "pnpm test", "npx vitest run", "bun test")),
    ("Go", "go", ("go test ./...", "make check")),
    ("Rust", "rs", ("cargo test", "cargo clippy --all-targets")),
    ("Ruby", "rb", ("bundle exec rspec", "rake test")),
    ("Java", "java", ("./gradlew test", "mvn -q test")),
)
MODELS = ("deepseek-v4-flash", "deepseek-v4-pro", "deepseek-chat", "dwarfstar-nano", "ds4")
_RULE = {"do": "{dorule}", "dont": "{dontrule}", "cond": "{caserule}"}
_SLOT = re.compile(r"\{(\w+)\}")


def _parse(text: str) -> dict[str, dict[str, list[str]]]:
    """The phrase bank's blocks: `words`, `topic NAME`, `tool NAME` -> slot -> alternatives."""
    lines: list[str] = []
    for raw in text.splitlines():
        if raw.startswith(" ") and lines:
            lines[-1] += " " + raw.strip()
        elif raw.strip():
            lines.append(raw.strip())
    blocks: dict[str, dict[str, list[str]]] = {}
    block: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith("@"):
            block = blocks.setdefault(line[1:], {})
            continue
        key, _, value = line.partition(" = ")
        values = [value] if key in ("param", "field") else [v.strip() for v in value.split("|")]
        block.setdefault(key, []).extend("" if v == "~" else v for v in values)
    return blocks


BANK = _parse(PHRASES)
WORDS = BANK["words"]
TOPICS = {name[6:]: slots for name, slots in BANK.items() if name.startswith("topic ") and name != "topic notes"}
NOTES = BANK["topic notes"]
TOOL_BANK = {name[5:]: slots for name, slots in BANK.items() if name.startswith("tool ")}


class Writer:
    """Random text from the phrase bank; `facts` fill the slots one prompt keeps fixed."""

    def __init__(self, rng: np.random.Generator, facts: dict[str, str]) -> None:
        self.rng, self.facts = rng, facts

    def pick(self, options: Sequence[Any]) -> Any:
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def some(self, options: Sequence[Any], n: int) -> list[Any]:
        return [options[i] for i in self.rng.permutation(len(options))[:n]]

    def say(self, template: str, block: Mapping[str, list[str]] | None = None) -> str:
        def fill(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in self.facts:
                return self.facts[name]
            if name == "num":
                return str(int(self.rng.integers(2, 400)))
            if name == "hex":
                return self.hexes(7)
            return self.say(self.pick((block or {}).get(name) or WORDS[name]), block)

        return _SLOT.sub(fill, template)

    def line(self, template: str, block: Mapping[str, list[str]] | None = None) -> str:
        """`template` expanded, its first letter upper-case."""
        text = self.say(template, block)
        return text[:1].upper() + text[1:]

    def hexes(self, n: int) -> str:
        return "".join(self.pick("0123456789abcdef") for _ in range(n))


@dataclass
class Style:
    """What one prompt keeps consistent: heading level, bullet mark, how descriptions are punctuated."""

    level: str
    bullet: str
    numbered: bool
    period: bool
    closed: bool  # `additionalProperties: false` in the schemas
    dialect: bool  # `$schema` in the schemas


@dataclass
class Section:
    heading: str
    intro: str
    rules: list[str]
    tail: str  # a sub-section or an example
    style: Style

    @property
    def text(self) -> str:
        parts = (self.heading, self.intro, _listed(self.rules, self.style), self.tail)
        return "\n\n".join(p for p in parts if p)


def _rules(w: Writer, topic: Mapping[str, list[str]], n: int) -> list[str]:
    """`n` rules, each on a different phrase of the topic; a condition keeps its own response."""
    cores = [(kind, i) for kind in ("do", "dont", "cond") for i in range(len(topic[kind]))]
    rules = []
    for kind, i in w.some(cores, n):
        pinned = {kind: [topic[kind][i]]} | ({"then": [topic["then"][i]]} if kind == "cond" else {})
        rules.append(w.line(_RULE[kind], {**topic, **pinned}))
    return rules


def _listed(rules: list[str], style: Style) -> str:
    if style.numbered:
        return "\n".join(f"{i}. {rule}" for i, rule in enumerate(rules, 1))
    return "\n".join(style.bullet + rule for rule in rules)


def _example(w: Writer, topic: Mapping[str, list[str]]) -> str:
    question, answer = (part.strip() for part in w.say(w.pick(topic["ex"]), topic).split("=>"))
    kind = int(w.rng.integers(3))
    if kind == 0:
        return f"<example>\nuser: {question}\nassistant: {answer}\n</example>"
    if kind == 1:
        return f"Example:\nUser: {question}\nYou: {answer}"
    return f"For instance, asked “{question}”, a good reply is: {answer}"


def _section(w: Writer, name: str, style: Style) -> Section:
    topic = TOPICS[name]
    intro = [w.say(s, topic) for s in w.some(topic["intro"], int(w.rng.integers(0, 3)))]
    intro += [w.say(w.pick(WORDS["lead"]))] if w.chance(0.3) else []
    rules = _rules(w, topic, int(w.rng.integers(3, 13)))
    cut = len(rules) - int(w.rng.integers(2, 5)) if len(rules) > 6 and w.chance(0.3) else len(rules)
    tail = _example(w, topic) if "ex" in topic and w.chance(0.4) else ""
    heading, sub = w.some(topic["heading"], 2)
    if cut < len(rules):  # the last rules under a sub-heading
        tail = f"{style.level}# {sub}\n\n{_listed(rules[cut:], style)}"
    return Section(f"{style.level} {heading}", " ".join(p for p in intro if p), rules[:cut], tail, style)


def sections(w: Writer, style: Style) -> Iterator[Section]:
    """An endless supply of sections, each topic once per round."""
    while True:
        for i in w.rng.permutation(len(TOPICS)):
            yield _section(w, sorted(TOPICS)[i], style)


# -- tools ----------------------------------------------------------------------------------------------
def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _tool_name(base: str, shape: str) -> str:
    if shape == "messages":
        return "".join(part.capitalize() for part in base.split("_"))
    return base.replace("_", "") if shape == "chat" else base


def _params(entry: Mapping[str, list[str]], shape: str) -> list[tuple[str, str, bool, list[str]]]:
    """(dotted path, type, required, descriptions) of the entry's parameters for `shape`."""
    out = []
    for line in entry.get("param", []) + entry.get("field", []):
        head, _, about = line.partition(" : ")
        path, kind, *limits = head.split()
        if limits and shape not in limits[0].strip("[]").split(","):
            continue
        out.append((path, kind.rstrip("!"), kind.endswith("!"), [a.strip() for a in about.split("|")]))
    return out


def _schema(w: Writer, params: list, parent: str, shape: str, style: Style, keep: str) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    required = []
    for path, kind, needed, about in params:
        prefix, _, name = path.rpartition(".")
        key = _camel(name) if shape == "chat" else name
        if prefix != parent or not (needed or key == keep or w.chance(0.85)):
            continue
        text = w.line(w.pick(about))
        prop: dict[str, Any] = {"type": "string"}
        if kind == "i":
            prop = {"type": "integer"} | ({"minimum": int(w.rng.integers(0, 2))} if w.chance(0.3) else {})
        elif kind == "b":
            prop = {"type": "boolean"}
        elif kind.startswith("e:"):
            prop = {"type": "string", "enum": kind[2:].split("/")}
        elif kind == "as":
            prop = {"type": "array", "items": {"type": "string"}}
        elif kind == "ao":
            prop = {"type": "array", "items": _schema(w, params, path, shape, style, keep)}
        prop["description"] = text + "." if style.period else text
        properties[key] = prop
        required += [key] if needed else []
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    return schema | ({"additionalProperties": False} if style.closed else {})


@dataclass
class Tool:
    name: str
    summary: str
    usage: str
    notes: list[str]
    parameters: dict[str, Any]

    def declaration(self, shape: str, bullet: str) -> dict[str, Any]:
        about = self.summary + (f"\n\n{self.usage}\n" + "\n".join(bullet + n for n in self.notes) if self.notes else "")
        if shape == "chat":
            return {
                "type": "function",
                "function": {"name": self.name, "description": about, "parameters": self.parameters},
            }
        if shape == "responses":
            return {"type": "function", "name": self.name, "description": about, "parameters": self.parameters}
        return {"name": self.name, "description": about, "input_schema": self.parameters}


def _tool(w: Writer, kind: str, name: str, shape: str, style: Style, keep: str = "") -> Tool:
    entry = TOOL_BANK[kind]
    notes = [w.line(n) for n in entry["note"]] + [w.say(n) for n in w.some(WORDS["toolnote"], 2)]
    notes = w.some(notes, int(w.rng.integers(2, 7)))
    parameters = _schema(w, _params(entry, shape), "", shape, style, keep)
    if style.dialect and shape == "messages":
        parameters["$schema"] = "http://json-schema.org/draft-07/schema#"
    return Tool(name, w.say(w.pick(entry["summary"])), w.pick(WORDS["usage"]), notes, parameters)


def tools(w: Writer, shape: str, style: Style, core: Sequence[tuple[str, str, str]]) -> list[Tool]:
    """The `core` tools, (bank entry, name, required parameter), and random others from the bank, 10 to 20
    tools in all, shuffled."""
    chosen: dict[str, Tool] = {}
    for kind, name, param in core:
        chosen[name] = chosen.get(name) or _tool(w, kind, name, shape, style, param)
    used = {kind for kind, *_ in core} | {"read", "list", "search"}
    bank = [k for k in TOOL_BANK if k not in used and (k != "shell" or shape == "chat")]
    for kind in w.some(bank, int(w.rng.integers(TOOL_COUNT[0], TOOL_COUNT[1] + 1)) - len(chosen)):
        name = _tool_name(w.pick(TOOL_BANK[kind]["names"]), shape)
        chosen.setdefault(name, _tool(w, kind, name, shape, style))
    order = list(chosen.values())
    return [order[i] for i in w.rng.permutation(len(order))]


# -- the environment ------------------------------------------------------------------------------------
def workspace(w: Writer) -> dict[str, str]:
    """The machine and project: label slot (agent_phrases.py) -> value, the working directory first."""
    darwin = w.chance(0.4)
    home = w.say(w.pick([h for h in WORDS["home"] if h.startswith("/Users") == darwin]))
    day = datetime.date(2024, 1, 1) + datetime.timedelta(days=int(w.rng.integers(0, 1400)))
    if darwin:
        platform, version = "darwin", f"Darwin {int(w.rng.integers(22, 26))}.{int(w.rng.integers(0, 7))}.0"
    else:
        platform, version = "linux", f"Linux 6.{int(w.rng.integers(1, 13))}.{int(w.rng.integers(0, 20))}-generic"
    return {
        "cwd": f"{home}/{w.say('{project}{suffix}')}",
        "isgit": "yes" if w.chance(0.85) else "no",
        "platform": platform,
        "osver": version,
        "date": w.pick([day.isoformat(), day.strftime("%a %b %d %Y"), f"{day.day} {day:%B %Y}"]),
        "shellname": w.pick(["bash", "zsh", "fish"]),
    }


def _git_block(w: Writer) -> str:
    branch = w.pick(["main", "master", "develop", f"feature/{w.say('{module}')}", f"fix/{w.say('{fnoun}')}"])
    changes = [f"{w.pick([' M', 'M ', '??', ' D', 'A '])} {w.say('{file}')}" for _ in range(int(w.rng.integers(0, 6)))]
    commits = [f"{w.hexes(7)} {w.say('{verb} {thing}')}" for _ in range(int(w.rng.integers(3, 6)))]
    lines = [w.say("{gitintro}"), f"{w.say('{branch}')}: {branch}", f"{w.say('{mainbranch}')}: main", ""]
    lines += [f"{w.say('{status}')}:", *(changes or [w.say("{clean}")]), "", f"{w.say('{commits}')}:", *commits]
    return "\n".join(lines)


def env_block(w: Writer, ws: Mapping[str, str], xml: bool) -> str:
    """The environment as `label: value` lines or as XML elements, with the model and the git state."""
    rows = [(k, ws[k]) for k in ("cwd", "isgit", "platform")]
    rows += w.some([(k, ws[k]) for k in ("osver", "date", "shellname")], int(w.rng.integers(1, 4)))
    if xml:
        tag = w.say("{envtag}")
        names = {"isgit": "git_repo", "osver": "os", "date": "current_date", "shellname": "shell"}
        body = "\n".join(f"  <{names.get(k, k)}>{v}</{names.get(k, k)}>" for k, v in rows)
        text = f"<{tag}>\n{body}\n</{tag}>"
    else:
        body = "\n".join(f"{w.say('{' + k + '}')}: {v}" for k, v in rows)
        intro = w.say("{envintro}")
        tagged = (intro + "\n" if intro else "") + f"<env>\n{body}\n</env>"
        text = w.pick([tagged, f"# {w.say('{envhead}')}\n\n{body}"])
    if w.chance(0.6):
        text += "\n" + w.say("{modelline}")
    return text + ("\n\n" + _git_block(w) if ws["isgit"] == "yes" and w.chance(0.75) else "")


def notes(w: Writer, ws: Mapping[str, str], style: Style) -> str:
    """The project's notes for agents, as a client reads them from a file in the project."""
    path = f"{ws['cwd']}/{w.say('{notesfile}')}"
    rules = _listed(_rules(w, NOTES, int(w.rng.integers(3, 8))), style)
    text = f"{w.say('{notesintro}', {'path': [path]})}\n\n{style.level} {w.say(w.pick(NOTES['heading']))}\n\n{rules}"
    wrap = w.say(w.pick(NOTES["wrap"]))
    return text + ("\n\n" + wrap if wrap else "")


def tagged(w: Writer, slot: str, text: str) -> str:
    tag = w.say("{" + slot + "}")
    return f"<{tag}>\n{text}\n</{tag}>" + w.pick(["", "\n"])
