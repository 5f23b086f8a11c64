"""`tool_eval`'s scores on a scripted model, which writes after each prompt the reply the server's
template renders for it: `greeting_endings` counts a held-out greeting as ended only when the reply
closes its turn within TURN_TOKENS with an answer and no call (nor DSML markup in the answer), and
counts the replies that open a call; `tool_call_accuracy` with the clients' own tools wants that
client's call, and under the server's guard never calls a tool the prompt does not declare."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.prompt.dsml import DSML
from dwarfstar.prompt.render_options import DS4
from dwarfstar.tokenizer.specials import EOS
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train.agent_data import agent_turns
from dwarfstar.train.agent_eval import HELDOUT_SEED, agent_scores, generated_prompts, prompt_options, report
from dwarfstar.train.agent_prompts import conversation
from dwarfstar.train.chat_data import CLIENT_TOOLS, TOOLS, PromptEncoder, ToolRequest, function_call
from dwarfstar.train.corpus import read_split
from dwarfstar.train.greetings import HELDOUT_GREETINGS
from dwarfstar.train.tool_eval import CORPUS, TURN_TOKENS, greeting_endings, tool_call_accuracy
from dwarfstar.train.trainer import NANO

SHAPE = "messages"


class ScriptedModel:
    """After a prompt it knows, writes that prompt's scripted reply, then `filler` for ever; its rows
    are one-hot logits, so the head is the identity."""

    def __init__(self, replies: dict[tuple[int, ...], list[int]], vocab: int, filler: int) -> None:
        self.replies, self.vocab, self.filler = replies, vocab, filler

    def new_state(self) -> list[int]:
        return []

    def hidden_batch(self, batch: list[torch.Tensor], states: list[list[int]], all_positions: bool = True):
        (ids,), (state,) = batch, states
        state.extend(ids.tolist())
        token = self.filler
        for prompt, reply in self.replies.items():
            n = len(state) - len(prompt)
            if tuple(state[: len(prompt)]) == prompt and n < len(reply):
                token = reply[n]
        return (torch.nn.functional.one_hot(torch.tensor([token]), self.vocab).float(),)


def test_only_an_answer_that_ends_within_the_budget_and_calls_nothing_counts() -> None:
    tokenizer = Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), NANO.vocab_size)
    encode = PromptEncoder(tokenizer)
    eos = tokenizer.token_id(EOS)
    call = function_call("read", {"path": "notes.txt"})
    assistants = {
        "say hello": {"tool_calls": [call]},  # an answer, and a call
        "ehi, ciao": {"tool_calls": [call]},  # an answer, and a call cut short: an invalid one
        "hey there": {"content": ""},  # an empty answer
        "good evening": {"content": "Good evening! " * TURN_TOKENS},  # past the budget
        "salve": {"content": f"Salve!</{DSML}tool_calls>"},  # a stray closing tag, left in the answer
    }
    replies = {}
    for words, _, _ in HELDOUT_GREETINGS:
        user = {"role": "user", "content": words}
        assistant = {"role": "assistant", "content": "Hello!", "reasoning_content": ""} | assistants.get(words, {})
        prompt = encode.render([user], tools=TOOLS[SHAPE], thinking=True, options=DS4)
        whole = encode.render([user, assistant], tools=TOOLS[SHAPE], thinking=True, options=DS4)
        assert whole[: len(prompt)] == prompt and whole[-1] == eos
        reply = whole[len(prompt) :]
        replies[tuple(prompt)] = reply[: len(reply) // 2] + [eos] if words == "ehi, ciao" else reply
    filler = tokenizer.encode(" and")[0]
    vocab = tokenizer.vocab_size
    model = ScriptedModel(replies, vocab, filler)
    ids = torch.arange(vocab)

    score = greeting_endings(model, lambda y: y, ids, ids, tokenizer, SHAPE, thinking=True)

    assert (score.ended, score.called, score.total) == (len(HELDOUT_GREETINGS) - 5, 2, len(HELDOUT_GREETINGS))


def test_with_the_clients_tools_only_the_clients_own_call_is_right() -> None:
    """Codex's shell after a Responses prompt that declares it: `cat` the file, quoted or not, `grep` a
    quoted text; the short prompts' `list` call, or a text with spaces left unquoted in the command
    (three words to the shell), is wrong."""
    tokenizer = Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), NANO.vocab_size)
    encode = PromptEncoder(tokenizer)
    shell = "exec_command"
    scripted = [  # the request, and the call the model writes
        (ToolRequest("read", "en", "open `notes.txt`", "notes.txt"), function_call(shell, {"cmd": "cat notes.txt"})),
        (ToolRequest("list", "en", "show me the folder `src`", "src"), function_call("list", {"path": "src"})),
        (ToolRequest("list", "en", "show me the folder `docs`", "docs"), function_call(shell, {"cmd": 'ls "docs"'})),
        (
            ToolRequest("search", "it", 'cerca "due parole"', "due parole"),
            function_call(shell, {"cmd": 'grep -rn "due parole" .'}),
        ),
        (
            ToolRequest("search", "en", 'search for "two words"', "two words"),
            function_call(shell, {"cmd": "grep -rn two words ."}),
        ),
    ]
    replies = {}
    for request, call in scripted:
        user = {"role": "user", "content": request.text}
        prompt = encode.render([user], tools=CLIENT_TOOLS["responses"], thinking=False, options=DS4)
        whole = encode.render(
            [user, {"role": "assistant", "content": "", "tool_calls": [call]}],
            tools=CLIENT_TOOLS["responses"],
            thinking=False,
            options=DS4,
        )
        replies[tuple(prompt)] = whole[len(prompt) :]
    vocab = tokenizer.vocab_size
    model = ScriptedModel(replies, vocab, tokenizer.encode(" and")[0])
    ids = torch.arange(vocab)
    requests = [request for request, _ in scripted]

    score = tool_call_accuracy(model, lambda y: y, ids, ids, tokenizer, requests, "responses", client=True)

    assert (score.right, score.named, score.total) == (3, 4, 5)


def test_under_the_guard_an_undeclared_tool_is_never_called() -> None:
    """The guard `serve` decodes under keeps a call to the declared tools: a scripted `list` call after
    a Codex prompt, which declares only its shell, comes out as a call of the shell."""
    tokenizer = Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), NANO.vocab_size)
    encode = PromptEncoder(tokenizer)
    request = ToolRequest("list", "en", "show me the folder `src`", "src")
    user = {"role": "user", "content": request.text}
    prompt = encode.render([user], tools=CLIENT_TOOLS["responses"], thinking=False, options=DS4)
    call = {"role": "assistant", "content": "", "tool_calls": [function_call("list", {"path": "src"})]}
    whole = encode.render([user, call], tools=CLIENT_TOOLS["responses"], thinking=False, options=DS4)
    vocab = tokenizer.vocab_size
    model = ScriptedModel({tuple(prompt): whole[len(prompt) :]}, vocab, tokenizer.encode(" and")[0])
    ids = torch.arange(vocab)

    free = tool_call_accuracy(model, lambda y: y, ids, ids, tokenizer, [request], "responses", client=True)
    guarded = tool_call_accuracy(
        model, lambda y: y, ids, ids, tokenizer, [request], "responses", client=True, guarded=True
    )

    assert free.samples == ["'show me the folder `src`' -> [('list', {'path': 'src'})]"]
    assert "exec_command" in guarded.samples[0] and "'list'" not in guarded.samples[0]


@pytest.mark.skipif(not CORPUS.exists(), reason="needs ../shared (the corpus)")
def test_agent_scores_count_the_bare_requests_apart() -> None:
    """`agent_eval` after held-out agent prompts: a model that calls right only where the request
    leaves the argument bare scores every bare request right and no quoted one, and says so."""
    tokenizer = Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), NANO.vocab_size)
    encode = PromptEncoder(tokenizer)
    book = read_split(CORPUS).train
    prompts = generated_prompts(6, (4000, 5000), lambda text: len(tokenizer.encode(text)))
    turns = agent_turns(book, 40 * len(prompts), HELDOUT_SEED, heldout=True)
    requests = [t for t in turns if t.kind != "greeting"][: len(prompts)]
    replies = {}
    for i, (prompt, turn) in enumerate(zip(prompts, requests, strict=True)):
        argument = turn.argument if not turn.request.quoted else "elsewhere"
        name, arguments = prompt.core[turn.kind].call(argument)
        user = [{"role": "user", "content": turn.text}]
        call = {
            "role": "assistant",
            "content": "",
            "reasoning_content": "",
            "tool_calls": [function_call(name, arguments)],
        }
        options = prompt_options(i)
        asked = encode.render(conversation(prompt, user), tools=prompt.tools, thinking=True, options=options)
        whole = encode.render(conversation(prompt, user + [call]), tools=prompt.tools, thinking=True, options=options)
        replies[tuple(asked)] = whole[len(asked) :]
    vocab = tokenizer.vocab_size
    model = ScriptedModel(replies, vocab, tokenizer.encode(" and")[0])
    ids = torch.arange(vocab)

    scores = agent_scores(model, lambda y: y, ids, ids, tokenizer, prompts, book)

    bare = sum(not t.request.quoted for t in requests)
    assert 0 < bare < len(requests)
    assert sum(s.requests for s in scores.values()) == len(requests)
    assert sum(s.bare for s in scores.values()) == bare
    assert sum(s.right for s in scores.values()) == sum(s.bare_right for s in scores.values()) == bare
    assert any(f"(bare arguments {s.bare_right}/{s.bare})" in line for s in scores.values() for line in report(scores))
