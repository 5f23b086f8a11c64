"""Chat-format training data for the nano model: thinking turns and tool-call round trips.

Every sample is a conversation rendered by our DeepSeek V4 renderer (the official `encoding_dsv4`
rules, or ds4's server layout, the two templates `dwarfstar serve` offers) and tokenized as the
server tokenizes a prompt, so the model learns exactly the bytes it is served:

- thinking turns: a few words of the book as the user turn; in thinking mode the reasoning is the
  sentence of the book that follows them (or, for a sentence too long, its first clauses up to a
  comma, semicolon or colon), then `</think>` and the text after it as the answer;
- tool round trips: the three tools of `TOOLS` declared in the system prompt in one of the three
  client shapes (chat completions, Responses, Messages; the server renders the client's schema as
  given), an Italian or English request answered by a DSML call whose argument is copied from it,
  the tool result, and an answer quoting the start of that result.

Request templates and arguments are split into a training and a held-out part (`tool_requests`),
so tests can ask what the model never saw; training can also invent arguments from word pieces
(`word_pieces`) and mix in synthetic copy runs (`copy_sample`), which teach the copy alone.
Only the assistant's output is a training target in a tool round trip: the tools section, the
request and the result are the client's text.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import regex

from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import DS4, OFFICIAL, RenderOptions
from dwarfstar.tokenizer.specials import ASSISTANT, EOS, USER, Control, PromptPart
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.train.greetings import greeting_set

TOOL_SPECS = (
    ("read", "Read a text file and return its content.", "path", "Path of the file to read."),
    ("list", "List the entries of a directory.", "path", "Path of the directory."),
    ("search", "Search the files for a text and return the matching lines.", "query", "Text to look for."),
)


def _schema(param: str, about: str) -> dict[str, Any]:
    return {"type": "object", "properties": {param: {"type": "string", "description": about}}, "required": [param]}


def declarations(shape: str, specs: Sequence[tuple[str, str, str, str]]) -> list[dict[str, Any]]:
    """Tools (name, description, parameter, its description) as a `shape` client declares them; the
    server renders the client's object as given."""
    if shape == "chat":
        return [
            {"type": "function", "function": {"name": n, "description": d, "parameters": _schema(p, pd)}}
            for n, d, p, pd in specs
        ]
    if shape == "responses":
        return [
            {"type": "function", "name": n, "description": d, "parameters": _schema(p, pd)} for n, d, p, pd in specs
        ]
    return [{"name": n, "description": d, "input_schema": _schema(p, pd)} for n, d, p, pd in specs]


TOOLS: dict[str, list[dict[str, Any]]] = {
    shape: declarations(shape, TOOL_SPECS) for shape in ("chat", "responses", "messages")
}


@dataclass(frozen=True)
class CoreTool:
    """A client's tool for a read, a list or a search request."""

    name: str  # the declared tool's name
    parameter: str  # its argument's name
    value: str  # format of the argument's value, "{}" or a shell command around it, e.g. "cat {}"

    def call(self, argument: str, quoted: bool = False) -> tuple[str, dict[str, str]]:
        """(name, arguments) of the call for a request's `argument`. A shell command double-quotes it
        where the request `quoted` or backticked it, or where it has spaces: after ` "` the argument
        is the request's own tokens (after a bare space, `cat altrettali.txt`, its first token is
        ` alt`, which a backticked request never holds, so the call could not copy it)."""
        if self.value != "{}" and (quoted or " " in argument):
            argument = f'"{argument}"'
        return self.name, {self.parameter: self.value.format(argument)}

    def accepts(self, call: tuple[str, dict[str, Any]], argument: str) -> bool:
        """Whether a model's (name, arguments) `call` is this tool's for `argument`: a shell command
        the same words however it quotes them (`cat "a.txt"` is `cat a.txt`, `grep -rn two words .`
        is not `grep -rn "two words" .`)."""
        name, arguments = call
        if name != self.name or set(arguments) != {self.parameter}:
            return False
        value = arguments[self.parameter]
        if self.value == "{}":
            return value == argument
        try:
            return shlex.split(str(value)) == shlex.split(self.value.format(shlex.quote(argument)))
        except ValueError:  # an unclosed quote
            return False


# `TOOLS`' own: each request's tool by its name, the argument as it is
TOOLS_CORE = {name: CoreTool(name, param, "{}") for name, _, param, _ in TOOL_SPECS}

# each client's own tools for the three requests, by shape (opencode, Claude Code, Codex). The agent
# prompts declare them among 10-20 others (agent_prompts.py); `tool_samples` can declare them alone,
# in a short prompt, so the names an agent's call needs get as many examples as `TOOLS`' do
CLIENT_CORE: dict[str, dict[str, CoreTool]] = {
    "chat": {
        "read": CoreTool("read", "filePath", "{}"),
        "list": CoreTool("list", "path", "{}"),
        "search": CoreTool("grep", "pattern", "{}"),
    },
    "messages": {
        "read": CoreTool("Read", "file_path", "{}"),
        "list": CoreTool("Bash", "command", "ls {}"),
        "search": CoreTool("Grep", "pattern", "{}"),
    },
    "responses": {
        "read": CoreTool("exec_command", "cmd", "cat {}"),
        "list": CoreTool("exec_command", "cmd", "ls {}"),
        "search": CoreTool("exec_command", "cmd", "grep -rn {} ."),
    },
}
_CLIENT_ABOUT = {  # tool name -> (description, parameter description), our own words
    "read": ("Read a file and return its lines.", "Path of the file to read."),
    "list": ("List the files and folders under a path.", "The folder to list."),
    "grep": ("Find the lines of the files that match a pattern.", "The pattern to look for."),
    "Read": ("Read a file of the local filesystem.", "Absolute path of the file."),
    "Bash": ("Run a bash command and return what it prints.", "The command to run."),
    "Grep": ("Search the contents of the files for a pattern.", "The pattern to search for."),
    "exec_command": ("Run a shell command and return its output.", "The command line to run."),
}


def _client_tools(shape: str) -> list[dict[str, Any]]:
    params = {t.name: t.parameter for t in CLIENT_CORE[shape].values()}  # a shell tool serves three requests
    return declarations(shape, [(n, _CLIENT_ABOUT[n][0], p, _CLIENT_ABOUT[n][1]) for n, p in params.items()])


CLIENT_TOOLS = {shape: _client_tools(shape) for shape in CLIENT_CORE}


TEMPLATES: dict[str, RenderOptions] = {"ds4": DS4, "official": OFFICIAL}

# (tool, language, template); the argument closes the request, so the call copies it from the last
# few tokens before `<｜Assistant｜>`, within the raw attention window. It is quoted: after a space
# the tokenizer splits a word otherwise than after the call's `">` (` donazione` is ` don`+`azione`,
# `donazione` after `">` is `don`+`azione`; no bare argument's call tokens occur in its request),
# so only a quoted argument can be copied token for token; a path in backticks, a text in quotes.
TRAIN_TEMPLATES = (
    ("read", "it", "leggi il file `{}`"),
    ("read", "it", "mostrami il contenuto di `{}`"),
    ("read", "it", "apri `{}`"),
    ("read", "en", "read the file `{}`"),
    ("read", "en", "show me the content of `{}`"),
    ("read", "en", "open `{}`"),
    ("list", "it", "elenca i file in `{}`"),
    ("list", "it", "cosa c'è nella cartella `{}`"),
    ("list", "it", "mostrami la cartella `{}`"),
    ("list", "en", "list the files in `{}`"),
    ("list", "en", "what is in the directory `{}`"),
    ("list", "en", "show me the folder `{}`"),
    ("search", "it", 'cerca "{}"'),
    ("search", "it", 'trova nei file il testo "{}"'),
    ("search", "it", 'cerca nei file "{}"'),
    ("search", "en", 'search for "{}"'),
    ("search", "en", 'find the text "{}"'),
    ("search", "en", 'search the files for "{}"'),
)
HELDOUT_TEMPLATES = (
    ("read", "it", "per favore leggi il file `{}`"),
    ("read", "en", "please read the file `{}`"),
    ("list", "it", "per favore elenca i file in `{}`"),
    ("list", "en", "please list the files in `{}`"),
    ("search", "it", 'per favore cerca "{}"'),
    ("search", "en", 'please search for "{}"'),
)


def bare(template: str) -> str:
    """A request template with its argument's backticks or quotes taken off."""
    return template.replace("`{}`", "{}").replace('"{}"', "{}")


DIRECTORIES = ("src", "docs", "tests", "lib", "data", "notes", "capitoli", "lettere", "config", "scripts")
EXTENSIONS = (".txt", ".md", ".py", ".json")
HELDOUT_EVERY = 5  # every fifth argument word is held out
_SENTENCE = regex.compile(r"[^.!?]*\p{L}[^.!?]*[.!?]")
_CLAUSE_END = regex.compile(r"[,;:]")
_ASCII_WORD = regex.compile(r"\b[a-z]{4,10}\b")
_PIECE = regex.compile(r"[a-z]+")
QUOTE_WORDS = (6, 12)  # words of the tool result the answer quotes
REASONING_TOKENS = (6, 40)  # the thinking passage: one sentence of this many tokens


# one short sentence of reasoning before `</think>`: what the turn needs
REASONING = {
    ("greeting", "it"): "L'utente mi saluta: rispondo in breve.",
    ("greeting", "en"): "The user greets me: a short answer.",
    ("read", "it"): "Devo leggere il file.",
    ("read", "en"): "I need to read the file.",
    ("list", "it"): "Devo elencare la cartella.",
    ("list", "en"): "I need to list the directory.",
    ("search", "it"): "Devo cercare il testo.",
    ("search", "en"): "I need to search the text.",
    ("answer", "it"): "Ho il risultato.",
    ("answer", "en"): "I have the result.",
}

# the final answer's fixed phrase before its quote of the tool result (`quoting_answer`)
ANSWER_INTROS = {
    ("read", "it"): "Il file dice:",
    ("read", "en"): "The file says:",
    ("list", "it"): "La cartella contiene:",
    ("list", "en"): "The directory contains:",
    ("search", "it"): "Ho trovato:",
    ("search", "en"): "I found:",
}


@dataclass(frozen=True)
class ToolRequest:
    tool: str
    language: str
    text: str  # the user's request
    argument: str  # the value the call must carry

    @property
    def quoted(self) -> bool:
        """Whether the request holds its argument in backticks or quotes (else it is bare)."""
        return any(f"{q}{self.argument}{q}" in self.text for q in '`"')


@dataclass(frozen=True)
class Sample:
    ids: np.ndarray  # token ids
    trained: np.ndarray  # bool per next-token target (len(ids) - 1): whether it is learned
    # ids[:prefix] are the same in many samples (a tool round trip's system prompt with the tools),
    # so training can run them once per step for all of those samples
    prefix: int = 0
    # ids[argument[0]:argument[1]] are the argument value the first tool call copies from the request
    argument: tuple[int, int] = (0, 0)


def argument_words(text: str) -> tuple[list[str], list[str]]:
    """Lower-case ASCII words of the book for file names and queries: (training, held-out)."""
    words = sorted(set(_ASCII_WORD.findall(text.lower())))
    heldout = words[::HELDOUT_EVERY]
    held = set(heldout)
    return [w for w in words if w not in held], heldout


def tool_argument(tool: str, word: Callable[[], str], rng: np.random.Generator) -> str:
    if tool == "search":
        return " ".join(word() for _ in range(int(rng.integers(1, 3))))
    name = word() + (str(EXTENSIONS[int(rng.integers(len(EXTENSIONS)))]) if tool == "read" else "")
    if rng.random() < 0.6:
        name = f"{DIRECTORIES[int(rng.integers(len(DIRECTORIES)))]}/{name}"
    return name


def word_pieces(text: str, tokenizer: Tokenizer) -> list[str]:
    """The lower-case letter tokens that the book's argument words (held-out ones too) split into,
    alone and as a bare call writes them (`bare_value`: `divor` from the request's ` divor|ato`).

    Invented arguments are made of them: a call can only copy a token the head was trained to
    emit, and a tenth of the held-out requests hold a piece that no training word has."""
    train_words, heldout_words = argument_words(text)
    words = train_words + heldout_words
    ids = {t for w in words for t in tokenizer.encode(w) + bare_value(w, tokenizer)}
    return sorted(p for p in (tokenizer.decode([t]) for t in ids) if _PIECE.fullmatch(p))


def bare_value(argument: str, tokenizer: Tokenizer) -> list[int]:
    """A bare argument's ids as a call copies them from the request. The request holds it after a
    space, `' divor', 'ato'`; the call's value has no space before it, so it opens with the ids of
    the first token's text without its space (`'divor'`), then copies the request's later ids
    (`'ato'`), where `encode(argument)` would split it otherwise (`'div', 'or', 'ato'`) and leave
    nothing to copy."""
    led = tokenizer.encode(" " + argument)
    return tokenizer.encode(tokenizer.decode(led[:1])[1:]) + led[1:]


def copied_spelling(ids: list[int], request: ToolRequest, tokenizer: Tokenizer) -> tuple[list[int], tuple[int, int]]:
    """A rendered round trip's `ids` with its call's value (`argument_span`) spelled as the call
    copies a bare request's argument (`bare_value`), and the value's span; a quoted request's
    argument, or a shell command (after its own space, `cat altrettali.txt` holds the request's
    ids), stays as it is. A greeting (no argument) has no call: its span is (0, 0)."""
    if not request.argument:
        return ids, (0, 0)
    start, end = span = argument_span(ids, tokenizer)
    if request.quoted or tokenizer.decode(ids[start:end]) != request.argument:
        return ids, span
    value = bare_value(request.argument, tokenizer)
    return ids[:start] + value + ids[end:], (start, start + len(value))


def copy_sample(pieces: np.ndarray, bos: int, rng: np.random.Generator, lengths: tuple[int, int]) -> Sample:
    """A synthetic copy task: BOS, a run of random piece ids, the same run again; the repeat after
    its first token is the target, which only attending back one run's length predicts (the
    induction a tool call's argument needs, the call being some 30 tokens after the request)."""
    run = pieces[rng.integers(len(pieces), size=int(rng.integers(lengths[0], lengths[1] + 1)))]
    ids = np.concatenate(([bos], run, run))
    trained = np.zeros(len(ids) - 1, dtype=bool)
    trained[len(run) + 1 :] = True  # targets ids[len(run) + 2:], the repeat after its first token
    return Sample(ids, trained)


def tool_requests(
    text: str,
    n: int,
    seed: int,
    *,
    heldout: bool,
    pieces: Sequence[str] | None = None,
    unquoted: float = 0.0,
) -> list[ToolRequest]:
    """`n` requests from the training (or held-out) templates with training (or held-out) arguments;
    with `pieces`, training templates with invented words of 1 to 3 random pieces (never a held-out
    word), so that only copying, not a memorised word, predicts them. An `unquoted` share of them
    leave the argument bare, as people also write it (`leggi il file quaderno.txt`); drawn apart, so
    the requests are the same ones whatever the share (1: all of them bare)."""
    rng = np.random.default_rng(seed)
    forms = np.random.default_rng(seed + 5)
    train_words, heldout_words = argument_words(text)
    templates, words = (HELDOUT_TEMPLATES, heldout_words) if heldout else (TRAIN_TEMPLATES, train_words)
    held = set(heldout_words)

    def word() -> str:
        if pieces is None:
            return str(words[int(rng.integers(len(words)))])
        while True:
            invented = "".join(str(pieces[int(i)]) for i in rng.integers(len(pieces), size=int(rng.integers(1, 4))))
            if invented not in held:
                return invented

    out = []
    for _ in range(n):
        tool, language, template = templates[int(rng.integers(len(templates)))]
        argument = tool_argument(tool, word, rng)
        if unquoted and forms.random() < unquoted:
            template = bare(template)
        out.append(ToolRequest(tool, language, template.format(argument), argument))
    return out


def book_sentences(text: str, tokenizer: Tokenizer) -> list[str]:
    spans = (" ".join(m.group().split()) for m in _SENTENCE.finditer(text))
    low, high = REASONING_TOKENS
    return [s for s in spans if low <= len(tokenizer.encode(s)) <= high]


def tool_result(request: ToolRequest, sentences: Sequence[str], rng: np.random.Generator) -> str:
    """What the client's tool returns: a passage of the book, a directory listing or matching lines."""
    passage = sentences[int(rng.integers(len(sentences)))]
    if request.tool == "read":
        return passage
    if request.tool == "list":
        names = {w.lower() for w in regex.findall(r"\p{L}{3,}", passage)}
        return "\n".join(f"{name}{EXTENSIONS[i % len(EXTENSIONS)]}" for i, name in enumerate(sorted(names)[:6]))
    return f"{request.argument.split()[0]}.txt:{int(rng.integers(1, 500))}: {passage}"


def quoting_answer(request: ToolRequest, result: str, rng: np.random.Generator) -> str:
    """The final answer: one fixed phrase per tool and language, then the start of the result."""
    words = result.split()
    quote = " ".join(words[: int(rng.integers(QUOTE_WORDS[0], QUOTE_WORDS[1] + 1))])
    return f'{ANSWER_INTROS[request.tool, request.language]} "{quote}"'


def function_call(name: str, arguments: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    """A tool call as an assistant message's `tool_calls` entry holds it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def round_trip(request: ToolRequest, result: str, answer: str, call_id: str = "call_0") -> list[dict[str, Any]]:
    """The conversation of one tool use: request, DSML call, tool result, final answer."""
    call = function_call(*TOOLS_CORE[request.tool].call(request.argument), call_id)
    return [
        {"role": "user", "content": request.text},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": answer},
    ]


def assistant_targets(ids: Sequence[int], tokenizer: Tokenizer) -> np.ndarray:
    """Which next-token targets are the assistant's output: from after the think token that follows
    `<｜Assistant｜>` (the prompt's, in either mode) through the EOS that closes the turn."""
    assistant, eos = tokenizer.token_id(ASSISTANT), tokenizer.token_id(EOS)
    trained = np.zeros(len(ids) - 1, dtype=bool)  # trained[i - 1]: whether ids[i] is learned
    inside = False
    for i in range(2, len(ids)):
        inside = inside or ids[i - 2] == assistant
        if inside:
            trained[i - 1] = True
            inside = ids[i] != eos
    return trained


class PromptEncoder:
    """`Tokenizer.encode_prompt` with each text run's ids remembered: thousands of samples share the
    same tools section, which is most of their text (same runs as encode_prompt: adjacent text joined)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.runs: dict[str, list[int]] = {}

    def _text(self, run: str) -> list[int]:
        if run not in self.runs:
            self.runs[run] = self.tokenizer.encode(run)
        return self.runs[run]

    def __call__(self, parts: Sequence[PromptPart]) -> list[int]:
        ids: list[int] = []
        run = ""
        for part in parts:
            if isinstance(part, Control):
                ids += self._text(run) if run else []
                ids.append(self.tokenizer.token_id(part.text))
                run = ""
            else:
                run += part
        return ids + (self._text(run) if run else [])

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None,
        thinking: bool,
        options: RenderOptions,
    ) -> list[int]:
        return self(render_conversation(messages, tools=tools, thinking=thinking, options=options).parts)


def argument_span(ids: Sequence[int], tokenizer: Tokenizer) -> tuple[int, int]:
    """Where the first DSML call's parameter value lies in `ids`: between the `string="true">` that
    opens it and the `</｜DSML｜parameter` that closes it (the value is text the request holds)."""
    dsml, close, parameter = (tokenizer.token_id(t) for t in ("｜DSML｜", "</", "parameter"))
    reply = list(ids).index(tokenizer.token_id(ASSISTANT))  # the system prompt shows the format too
    end = next(
        i for i in range(reply, len(ids) - 1) if ids[i] == dsml and ids[i + 1] == parameter and ids[i - 1] == close
    )
    opener = tokenizer.encode('="true">')
    start = next(i for i in range(end - len(opener), reply, -1) if list(ids[i : i + len(opener)]) == opener)
    return start + len(opener), end - 1


def name_start(ids: Sequence[int], value: int, invoke: list[int]) -> int:
    """Where the tool name of the call whose parameter value starts at `value` starts in `ids`: after
    the last `invoke` ids (`encode('invoke name="')`) before it."""
    n = len(invoke)
    return next(i for i in range(value - n, 0, -1) if list(ids[i : i + n]) == invoke) + n


def tool_samples(
    text: str,
    tokenizer: Tokenizer,
    n: int,
    seed: int,
    thinking_share: float,
    *,
    heldout: bool = False,
    pieces: Sequence[str] | None = None,
    greetings: float = 0.0,
    reasoning: bool = False,
    client_tools: float = 0.0,
    composed_greetings: bool = False,
    unquoted: float = 0.0,
) -> list[Sample]:
    """`n` rendered tool round trips over training (or held-out) templates and arguments, in every
    client shape and both server templates; a `thinking_share` of them in thinking mode, with empty
    reasoning or (`reasoning`) the agent turns' one sentence for the turn (`REASONING`: what it needs,
    in the request's language). A `greetings` share of the samples are a greeting and its answer
    instead: the turns after an agent's prompt (agent_data.py) on the short tools prompts, where a
    step is cheap, so the request decides reasoning, call or answer in both places. A `client_tools`
    share declare the shape's client's own core tools instead (`CLIENT_TOOLS`) and call them (drawn
    apart, so a share of 0 leaves the samples as they were). The greetings are `GREETINGS`, or with
    `composed_greetings` the five hundred of `COMPOSED_GREETINGS`. An `unquoted` share of the requests
    leave their argument bare (`tool_requests`)."""
    rng = np.random.default_rng(seed + 1)
    clients = np.random.default_rng(seed + 3)
    sentences = book_sentences(text, tokenizer)
    shapes, templates = sorted(TOOLS), sorted(TEMPLATES)
    greetings_drawn = greeting_set(heldout, composed_greetings)
    encode = PromptEncoder(tokenizer)
    samples = []
    for request in tool_requests(text, n, seed, heldout=heldout, pieces=pieces, unquoted=unquoted):
        result = tool_result(request, sentences, rng)
        kinds = [request.tool, "answer"]
        if greetings and rng.random() < greetings:
            words, language, answer = greetings_drawn[int(rng.integers(len(greetings_drawn)))]
            messages = [{"role": "user", "content": words}, {"role": "assistant", "content": answer}]
            kinds = ["greeting"]
            request = ToolRequest("greeting", language, words, "")
        else:
            messages = round_trip(request, result, quoting_answer(request, result, rng))
        thinking = bool(rng.random() < thinking_share)
        if thinking:
            turns = iter(kinds)
            for m in messages:
                if m["role"] == "assistant":
                    m["reasoning_content"] = REASONING[next(turns), request.language] if reasoning else ""
        shape = shapes[int(rng.integers(len(shapes)))]
        options = TEMPLATES[templates[int(rng.integers(len(templates)))]]
        declared = TOOLS[shape]
        if client_tools and clients.random() < client_tools:
            declared = CLIENT_TOOLS[shape]
            if request.argument:
                messages[1]["tool_calls"] = [
                    function_call(*CLIENT_CORE[shape][request.tool].call(request.argument, request.quoted))
                ]
        ids = encode.render(messages, tools=declared, thinking=thinking, options=options)
        prefix = ids.index(tokenizer.token_id(USER))  # the system prompt, the tools section in it
        ids, span = copied_spelling(ids, request, tokenizer)
        samples.append(Sample(np.asarray(ids, dtype=np.int64), assistant_targets(ids, tokenizer), prefix, span))
    return samples


def thinking_samples(
    text: str, tokenizer: Tokenizer, prompts: Sequence[tuple[str, int]], length: int, rng: np.random.Generator
) -> list[Sample]:
    """Thinking-mode chats: for each (user words, end offset in `text`), the next sentence of the book
    as the reasoning, then the text after it as the answer, cut at `length` tokens. A sentence longer
    than the reasoning's budget is cut after its last comma, semicolon or colon within the budget
    (Manzoni's sentences often run past a hundred tokens, and a model that only saw short sentences
    closed never reasons past one it cannot finish: served thinking never ended)."""
    low, high = REASONING_TOKENS
    samples = []
    for prompt, end in prompts:
        match = _SENTENCE.match(text, end)
        if match is None:
            continue
        # the whole sentence, else its longest first clauses: the first of these that fits the budget
        stops = [match.end(), *reversed([c.end() for c in _CLAUSE_END.finditer(text, end, match.end())])]
        stop = next((s for s in stops if low <= len(tokenizer.encode(" ".join(text[end:s].split()))) <= high), None)
        if stop is None:
            continue
        reasoning = " ".join(text[end:stop].split())
        answer = text[stop : stop + length * 8].lstrip()  # more text than `length` tokens need
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "reasoning_content": reasoning, "content": answer, "wo_eos": True},
        ]
        options = TEMPLATES[sorted(TEMPLATES)[int(rng.integers(len(TEMPLATES)))]]
        ids = PromptEncoder(tokenizer).render(messages, tools=None, thinking=True, options=options)
        if len(ids) < length:
            continue
        ids = ids[:length]
        trained = np.ones(length - 1, dtype=bool)
        opener = ids.index(tokenizer.token_id(ASSISTANT))
        trained[opener - 1 : opener + 1] = False  # the end of the user turn and the prompt's <think>
        samples.append(Sample(np.asarray(ids, dtype=np.int64), trained))
    return samples


def call_only(sample: Sample, eos: int) -> Sample:
    """A tool round trip cut after its call's EOS: the request and the call."""
    end = int(np.flatnonzero(sample.ids == eos)[0]) + 1
    return Sample(sample.ids[:end], sample.trained[: end - 1], sample.prefix, sample.argument)
