"""The nano model's chat training data (dwarfstar/train/chat_data.py): the bytes the renderer and the
official tokenizer give, the assistant-only targets, DSML that parses to the request, and held-out
requests the training never shows."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from dwarfstar.prompt.dsml_parser import parse_completion
from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import DS4, OFFICIAL
from dwarfstar.tokenizer.specials import EOS, THINK_END
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train import chat_data
from dwarfstar.train.corpus import chat_prompts, read_split
from dwarfstar.train.greetings import GREETINGS

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
# a slice of the book keeps the sentence pool (every sentence is tokenized) quick
BOOK_CHARS = 60_000


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), 129280)


@pytest.fixture(scope="module")
def book() -> str:
    return read_split(CORPUS).train[:BOOK_CHARS]


@pytest.fixture(scope="module")
def tool_samples(book: str, tok: Tokenizer) -> list[chat_data.Sample]:
    return chat_data.tool_samples(book, tok, 24, seed=3, thinking_share=0.5)


def output_text(sample: chat_data.Sample, tok: Tokenizer) -> str:
    return tok.decode([int(i) for i, t in zip(sample.ids[1:], sample.trained, strict=True) if t])


def test_prompt_encoder_is_encode_prompt(book: str, tok: Tokenizer) -> None:
    encode = chat_data.PromptEncoder(tok)
    for request in chat_data.tool_requests(book, 6, seed=0, heldout=False):
        messages = chat_data.round_trip(request, "Renzo e Lucia.", 'Il file dice: "Renzo e Lucia."')
        for options in (OFFICIAL, DS4):
            prompt = render_conversation(messages, tools=chat_data.TOOLS["chat"], options=options)
            assert encode(prompt.parts) == tok.encode_prompt(prompt.parts)
            assert encode(prompt.parts) == encode(prompt.parts)  # and again from the remembered runs


def test_official_rendering_tokenizes_as_the_official_tokenizer(book: str, tok: Tokenizer) -> None:
    """A round trip in the official template: our ids are the official tokenizer.json's ids of the
    text our renderer writes (the renderer is checked byte for byte against the official encoder's
    own outputs in tests/test_prompt.py)."""
    official = HFTokenizer.from_file(str(bundled_tokenizer_json()))
    for request in chat_data.tool_requests(book, 6, seed=1, heldout=False):
        messages = chat_data.round_trip(request, "Don Abbondio.", 'Il file dice: "Don Abbondio."')
        for thinking in (False, True):
            prompt = render_conversation(messages, tools=chat_data.TOOLS["chat"], thinking=thinking)
            ids = chat_data.PromptEncoder(tok)(prompt.parts)
            assert ids == official.encode(prompt.text, add_special_tokens=False).ids


def test_tool_samples_train_only_the_assistant_output(tool_samples: list[chat_data.Sample], tok: Tokenizer) -> None:
    for sample in tool_samples:
        text = tok.decode(sample.ids.tolist())
        outputs = output_text(sample, tok)
        assert outputs.count(EOS) == 2  # the call turn and the answer turn
        call_turn, answer_turn, _ = outputs.split(EOS)
        assert "<｜DSML｜tool_calls>" in call_turn and "## Tools" not in outputs and "<｜User｜>" not in outputs
        assert answer_turn.removeprefix(THINK_END).split(":")[0] in {
            "Il file dice",
            "The file says",
            "La cartella contiene",
            "The directory contains",
            "Ho trovato",
            "I found",
        }
        assert text.endswith(answer_turn + EOS)


def test_tool_calls_parse_to_the_requested_tool_and_argument(
    book: str, tool_samples: list[chat_data.Sample], tok: Tokenizer
) -> None:
    requests = chat_data.tool_requests(book, 24, seed=3, heldout=False)  # the samples' requests, same seed
    for request, sample in zip(requests, tool_samples, strict=True):
        text = tok.decode(sample.ids.tolist())
        assert f"<｜User｜>{request.text}<｜Assistant｜>" in text
        call_turn = output_text(sample, tok).split(EOS)[0]
        thinking = call_turn.startswith(THINK_END)
        parsed = parse_completion(call_turn.removeprefix(THINK_END) + EOS, thinking=False)
        assert not parsed.problems, (thinking, call_turn)
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
            (request.tool, {chat_data.TOOLS_CORE[request.tool].parameter: request.argument})
        ]
        # copied from the request's end, where it is quoted
        assert request.text.endswith((f"`{request.argument}`", f'"{request.argument}"'))


def test_the_call_copies_the_requests_argument_tokens(book: str, tok: Tokenizer) -> None:
    """The call's argument is the same token ids as in the request (what a model can copy), and
    `argument_span` finds them in the call, for held-out, training and invented requests alike."""
    pieces = chat_data.word_pieces(book, tok)
    for kwargs in ({"heldout": True}, {"heldout": False}, {"heldout": False, "pieces": pieces}):
        requests = chat_data.tool_requests(book, 30, seed=5, **kwargs)
        samples = chat_data.tool_samples(book, tok, 30, seed=5, thinking_share=0.5, **kwargs)
        for request, sample in zip(requests, samples, strict=True):
            start, end = sample.argument
            ids = sample.ids.tolist()
            assert tok.decode(ids[start:end]) == request.argument
            assert ids[end : end + 3] == [tok.token_id(t) for t in ("</", "｜DSML｜", "parameter")]
            request_ids = ids[sample.prefix : ids.index(tok.token_id("<｜Assistant｜>"))]
            n = end - start
            assert any(request_ids[i : i + n] == ids[start:end] for i in range(len(request_ids))), request.text


def test_unquoted_requests_are_the_same_requests_with_the_argument_bare(book: str) -> None:
    for heldout in (True, False):
        quoted = chat_data.tool_requests(book, 30, seed=2, heldout=heldout)
        unquoted = chat_data.tool_requests(book, 30, seed=2, heldout=heldout, unquoted=1.0)
        for q, u in zip(quoted, unquoted, strict=True):
            assert (u.tool, u.language, u.argument) == (q.tool, q.language, q.argument)
            assert q.quoted and not u.quoted
            marked = next(m for m in (f"`{q.argument}`", f'"{q.argument}"') if m in q.text)
            assert u.text == q.text.replace(marked, q.argument) and u.text.endswith(f" {q.argument}")


def test_a_share_of_the_tool_samples_ask_with_the_argument_bare_and_the_call_still_carries_it(
    book: str, tok: Tokenizer
) -> None:
    quoted = chat_data.tool_requests(book, 80, seed=3, heldout=False)
    requests = chat_data.tool_requests(book, 80, seed=3, heldout=False, unquoted=0.5)
    samples = chat_data.tool_samples(book, tok, 80, seed=3, thinking_share=0.0, client_tools=0.5, unquoted=0.5)
    assert [(r.tool, r.argument) for r in requests] == [(r.tool, r.argument) for r in quoted]
    assert 25 <= sum(not r.quoted for r in requests) <= 55
    forms = set()
    for request, sample in zip(requests, samples, strict=True):
        assert f"<｜User｜>{request.text}<｜Assistant｜>" in tok.decode(sample.ids.tolist())
        (call,) = parse_completion(output_text(sample, tok).split(EOS)[0] + EOS, thinking=False).tool_calls
        client = [core[request.tool] for core in chat_data.CLIENT_CORE.values()]
        expected = [(request.tool, {chat_data.TOOLS_CORE[request.tool].parameter: request.argument})]
        expected += [tool.call(request.argument, request.quoted) for tool in client]
        assert (call.name, call.arguments) in expected, (request, call)
        shell = any(t.value != "{}" and t.name == call.name for t in client)
        forms.add((request.quoted, shell))
    assert forms == {(True, True), (True, False), (False, True), (False, False)}


def test_a_shell_tool_quotes_as_the_request_does_and_accepts_any_quoting_of_the_same_words() -> None:
    cat, grep = chat_data.CLIENT_CORE["responses"]["read"], chat_data.CLIENT_CORE["responses"]["search"]
    request = chat_data.ToolRequest("read", "en", "open `a.txt`", "a.txt")
    assert request.quoted and not chat_data.ToolRequest("read", "en", "open a.txt", "a.txt").quoted
    assert cat.call("a.txt", request.quoted) == ("exec_command", {"cmd": 'cat "a.txt"'})
    assert cat.call("a.txt") == ("exec_command", {"cmd": "cat a.txt"})
    assert grep.call("two words") == ("exec_command", {"cmd": 'grep -rn "two words" .'})
    for command in ("cat a.txt", 'cat "a.txt"', "cat 'a.txt'"):
        assert cat.accepts(("exec_command", {"cmd": command}), "a.txt")
    for call in (
        ("exec_command", {"cmd": "cat b.txt"}),
        ("exec_command", {"cmd": 'cat "a.txt'}),  # an unclosed quote
        ("exec_command", {"cmd": "cat a.txt", "workdir": "."}),
        ("read", {"cmd": "cat a.txt"}),
    ):
        assert not cat.accepts(call, "a.txt"), call
    assert not grep.accepts(("exec_command", {"cmd": "grep -rn two words ."}), "two words")
    read = chat_data.CLIENT_CORE["chat"]["read"]
    assert read.accepts(("read", {"filePath": "a.txt"}), "a.txt")
    assert not read.accepts(("read", {"filePath": '"a.txt"'}), "a.txt")


def test_invented_arguments_are_book_pieces_and_never_a_heldout_word(book: str, tok: Tokenizer) -> None:
    pieces = chat_data.word_pieces(book, tok)
    _, heldout_words = chat_data.argument_words(book)
    assert pieces and all(p.isascii() and p.isalpha() and p.islower() for p in pieces)
    requests = chat_data.tool_requests(book, 300, seed=0, heldout=False, pieces=pieces)
    train_texts = {r.text for r in chat_data.tool_requests(book, 300, seed=0, heldout=False)}
    assert not train_texts & {r.text for r in requests}  # other arguments than the book words'
    for request in requests:
        words = request.argument.replace("/", " ").replace(".", " ").split()
        words = [w for w in words if w not in chat_data.DIRECTORIES and f".{w}" not in chat_data.EXTENSIONS]
        assert not set(words) & set(heldout_words)
        assert all(w.isascii() and w.isalpha() and w.islower() for w in words)


def test_copy_sample_repeats_a_run_and_trains_only_the_repeat() -> None:
    pieces = np.arange(100, 200)
    for seed in range(5):
        sample = chat_data.copy_sample(pieces, 0, np.random.default_rng(seed), (3, 9))
        n = (len(sample.ids) - 1) // 2
        assert 3 <= n <= 9 and sample.ids[0] == 0
        assert sample.ids[1 : n + 1].tolist() == sample.ids[n + 1 :].tolist()
        assert set(sample.ids[1:].tolist()) <= set(pieces.tolist())
        # targets are the repeat's tokens after its first one (that one nothing predicts)
        assert np.flatnonzero(sample.trained).tolist() == list(range(n + 1, 2 * n))


def test_answer_quotes_the_tool_result(book: str, tok: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    sentences = ["Quel ramo del lago di Como, che volge a mezzogiorno, tra due catene non interrotte di monti."]
    for request in chat_data.tool_requests(book, 12, seed=2, heldout=False):
        result = chat_data.tool_result(request, sentences, rng)
        answer = chat_data.quoting_answer(request, result, rng)
        quote = answer.split('"')[1]
        assert len(quote.split()) >= chat_data.QUOTE_WORDS[0] or quote == result
        assert " ".join(result.split()).startswith(quote)  # a listing is quoted on one line


def test_heldout_requests_share_no_template_or_argument_with_training(book: str) -> None:
    train = chat_data.tool_requests(book, 400, seed=0, heldout=False)
    heldout = chat_data.tool_requests(book, 60, seed=0, heldout=True)
    train_words, heldout_words = chat_data.argument_words(book)
    assert not set(train_words) & set(heldout_words)
    train_templates = {t for _, _, t in chat_data.TRAIN_TEMPLATES}
    for request in heldout:
        assert not any(request.text == t.format(request.argument) for t in train_templates)
        for word in request.argument.replace("/", " ").replace(".", " ").split():
            assert word in heldout_words or word in chat_data.DIRECTORIES or f".{word}" in chat_data.EXTENSIONS
    assert {r.tool for r in heldout} == {"read", "list", "search"} and {r.language for r in heldout} == {"it", "en"}
    assert not {r.text for r in train} & {r.text for r in heldout}


def test_thinking_samples_reason_with_one_sentence_or_its_first_clauses_then_answer(book: str, tok: Tokenizer) -> None:
    prompts = chat_prompts(book, 40, seed=0)
    samples = chat_data.thinking_samples(book, tok, prompts, 120, np.random.default_rng(0))
    assert len(samples) >= 5
    ends = set()
    for sample in samples:
        assert len(sample.ids) == 120
        text = tok.decode(sample.ids.tolist())
        prompt, output = text.split("<｜Assistant｜><think>")
        reasoning, answer = output.split(THINK_END)
        low, high = chat_data.REASONING_TOKENS
        assert low <= len(tok.encode(reasoning)) <= high and answer
        assert reasoning.rstrip()[-1] in ".!?,;:"
        ends.add(reasoning.rstrip()[-1] in ".!?")
        # both are the book's own text
        flat = " ".join(book.split())
        assert " ".join(reasoning.split()) in flat and " ".join(answer[:40].split()) in flat
        # the book words of both turns are learned; the end of the user turn and the prompt's <think> are not
        opener = sample.ids.tolist().index(tok.token_id("<｜Assistant｜>"))
        assert np.flatnonzero(~sample.trained).tolist() == [opener - 1, opener]
        assert prompt.startswith("<｜begin▁of▁sentence｜><｜User｜>")
    assert ends == {True, False}  # whole sentences and the first clauses of long ones


def test_tool_prefix_is_the_system_prompt_shared_by_shape_and_template(
    tool_samples: list[chat_data.Sample], tok: Tokenizer
) -> None:
    """Training runs ids[:prefix] once for every sample that shares it: it must be the same tokens
    for a client shape and template, hold the tools section, train nothing, and end at the request."""
    prefixes = {sample.ids[: sample.prefix].tobytes() for sample in tool_samples}
    assert 1 < len(prefixes) <= len(chat_data.TOOLS) * len(chat_data.TEMPLATES)
    for sample in tool_samples:
        prefix = tok.decode(sample.ids[: sample.prefix].tolist())
        assert "## Tools" in prefix and '"read"' in prefix and "<｜User｜>" not in prefix
        assert sample.ids[sample.prefix] == tok.token_id("<｜User｜>")
        assert not sample.trained[: sample.prefix].any()


def test_tools_prompts_can_carry_the_agent_turns_reasoning_and_greetings(book: str, tok: Tokenizer) -> None:
    """With `reasoning` a thinking turn reasons in the agent turns' sentence for what the request needs,
    in the request's language; with `greetings` some samples are a greeting answered with no call. The
    default keeps the bundled recipe's data: empty reasoning, no greeting."""
    requests = chat_data.tool_requests(book, 40, seed=7, heldout=False)
    plain = chat_data.tool_samples(book, tok, 40, seed=7, thinking_share=1.0)
    turns = chat_data.tool_samples(book, tok, 40, seed=7, thinking_share=1.0, greetings=0.4, reasoning=True)
    assert all(output_text(s, tok).startswith(THINK_END) for s in plain)  # `<think>` in the prompt, empty
    answers = {answer for _, _, answer in GREETINGS}
    greeted = 0
    for sample in turns:
        text = tok.decode(sample.ids.tolist())
        user = text.split("<｜User｜>")[1].split("<｜Assistant｜>")[0]
        outputs = output_text(sample, tok).split(EOS)[:-1]
        greeting = next((g for g in GREETINGS if g[0] == user), None)
        if greeting is not None:
            greeted += 1
            assert outputs == [f"{chat_data.REASONING['greeting', greeting[1]]}{THINK_END}{greeting[2]}"]
            assert greeting[2] in answers and sample.argument == (0, 0)
            continue
        request = next(r for r in requests if r.text == user)
        call, answer = outputs
        assert call.startswith(chat_data.REASONING[request.tool, request.language] + THINK_END)
        assert answer.startswith(chat_data.REASONING["answer", request.language] + THINK_END)
        assert tok.decode(sample.ids[slice(*sample.argument)].tolist()) == request.argument
    assert 8 <= greeted <= 24  # about 40% of 40


def test_tools_prompts_can_declare_and_call_the_clients_own_tools(book: str, tok: Tokenizer) -> None:
    """With `client_tools` a share of the samples declare one client's own tools for a read, a list and
    a search, only those, and call them as its agent prompts' turns do: opencode's `read`/`filePath`,
    Claude Code's `Read`, `Bash` (`ls`) and `Grep`, Codex's one shell tool, whose command quotes the
    argument as these requests all do. The others keep `TOOLS`; every sample's prefix is still one
    per tool set, shape and template."""

    def shell(a: str) -> str:
        return f'"{a}"'

    calls = {  # declared names -> request tool -> the call for argument `a`
        ("list", "read", "search"): {
            t: (lambda a, t=t: (t, {chat_data.TOOLS_CORE[t].parameter: a})) for t in ("read", "list", "search")
        },
        ("grep", "list", "read"): {
            "read": lambda a: ("read", {"filePath": a}),
            "list": lambda a: ("list", {"path": a}),
            "search": lambda a: ("grep", {"pattern": a}),
        },
        ("Bash", "Grep", "Read"): {
            "read": lambda a: ("Read", {"file_path": a}),
            "list": lambda a: ("Bash", {"command": f"ls {shell(a)}"}),
            "search": lambda a: ("Grep", {"pattern": a}),
        },
        ("exec_command",): {
            "read": lambda a: ("exec_command", {"cmd": f"cat {shell(a)}"}),
            "list": lambda a: ("exec_command", {"cmd": f"ls {shell(a)}"}),
            "search": lambda a: ("exec_command", {"cmd": f"grep -rn {shell(a)} ."}),
        },
    }
    requests = chat_data.tool_requests(book, 60, seed=5, heldout=False)
    samples = chat_data.tool_samples(book, tok, 60, seed=5, thinking_share=0.5, client_tools=0.5)
    seen: dict[tuple[str, ...], int] = {}
    for request, sample in zip(requests, samples, strict=True):
        prefix = tok.decode(sample.ids[: sample.prefix].tolist())
        declared = tuple(sorted(set(re.findall(r'"name": ?"(\w+)"', prefix))))
        seen[declared] = seen.get(declared, 0) + 1
        call_turn = output_text(sample, tok).split(EOS)[0].removeprefix(THINK_END)
        parsed = parse_completion(call_turn + EOS, thinking=False)
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [calls[declared][request.tool](request.argument)]
        value = tok.decode(sample.ids[slice(*sample.argument)].tolist())
        assert value == next(iter(parsed.tool_calls[0].arguments.values()))  # the span weighed as the argument
    assert set(seen) == set(calls) and 20 <= seen["list", "read", "search"] <= 40  # about half of 60
    assert len({s.ids[: s.prefix].tobytes() for s in samples}) <= 4 * len(chat_data.TEMPLATES) + 2 * 2


@pytest.mark.parametrize("reasoning", [True, False])
def test_the_decision_weight_lands_on_each_turn_s_first_reply_token(reasoning: bool, book: str, tok: Tokenizer):
    """`Trainer.weights`: the first reply token after a tools prompt (reasoning, answer or call: the one
    that decides from the request alone; after an empty reasoning's `</think>`, the token after it)
    takes `decision_weight`; the call's argument keeps its own."""
    from types import SimpleNamespace

    from dwarfstar.train.trainer import Recipe, Trainer

    recipe = Recipe(decision_weight=8.0, call_weight=2.0, arg_weight=3.0, first_weight=5.0, answer_weight=4.0)
    trainer = SimpleNamespace(recipe=recipe, eos=tok.eos_id, think_end=tok.token_id(THINK_END))
    samples = chat_data.tool_samples(book, tok, 12, seed=9, thinking_share=0.5, greetings=0.5, reasoning=reasoning)
    kinds, decided = set(), set()
    for sample in samples:
        weights = Trainer.weights(trainer, sample)  # one per target from the prefix on
        (first,) = np.flatnonzero(weights == 8.0)
        targets = [tok.decode([int(t)]) for t in sample.ids[sample.prefix + 1 : sample.prefix + first + 2]]
        before = [
            t
            for t, trained in zip(targets, sample.trained[sample.prefix : sample.prefix + first + 1], strict=True)
            if trained
        ][:-1]
        assert targets[-1] != THINK_END and set(before) <= {THINK_END}  # nothing but `</think>` before it
        decided.add(targets[-1])
        start, end = sample.argument
        kinds.add(bool(end))
        if end:
            assert (
                weights[start - 1 - sample.prefix] == 5.0
                and (weights[start - sample.prefix : end - sample.prefix] == 3.0).all()
            )
    assert kinds == {True, False}  # greetings and calls both checked
    assert len(decided) > 1  # the weighted token differs between turns: it is the one that decides


def test_the_name_weight_lands_on_the_call_s_tool_name(book: str, tok: Tokenizer):
    """`Trainer.weights` with `name_weight`: in each round trip one target takes it, the one that
    predicts the call's tool name's first token (`read`, `Read`, `B` of `Bash`, `exec` of
    `exec_command`), in every shape, with the clients' tools too; a greeting has none."""
    from types import SimpleNamespace

    from dwarfstar.train.trainer import Recipe, Trainer

    recipe = Recipe(name_weight=7.0, decision_weight=8.0, call_weight=2.0, first_weight=5.0)
    trainer = SimpleNamespace(
        recipe=recipe, eos=tok.eos_id, think_end=tok.token_id(THINK_END), invoke=tok.encode('invoke name="')
    )
    samples = chat_data.tool_samples(
        book, tok, 40, seed=3, thinking_share=0.5, greetings=0.3, client_tools=0.5, unquoted=0.5
    )
    named = set()
    for sample in samples:
        weighted = np.flatnonzero(Trainer.weights(trainer, sample) == 7.0) + sample.prefix
        if not sample.argument[1]:
            assert not weighted.size
            continue
        (target,) = weighted
        first = tok.decode([int(sample.ids[target + 1])])
        named.add(first)
        assert tok.decode(sample.ids[target - 4 : target + 1].tolist()).endswith('invoke name="'), first
        assert first in {"read", "list", "search", "Read", "B", "G", "g", "exec"}
    assert {"read", "list", "search"} <= named and len(named) >= 6
