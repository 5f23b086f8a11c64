"""Control tokens never reach a client as text (output.py): the sampler refuses the ones an answer has no
place for, and the output decoder drops any that still come.

The scripted backend steers the sampler towards `<｜User｜>` or `<｜Assistant｜>` in the middle of an
answer; the reply must hold text only, the rest of the script around the refused token.
"""

from __future__ import annotations

import re

from dwarfstar.sampling import SamplingParams
from dwarfstar.serving.generation import GenerationRequest
from dwarfstar.serving.output import OutputDecoder, refused_ids
from dwarfstar.tokenizer import specials

MODEL = "deepseek-v4-flash"
CONTROL = re.compile("<｜[^｜<>]+｜>|</?think>")  # any control token's text


def test_role_token_in_an_answer_is_refused(oai):
    ask = {"role": "user", "content": "[[script:role_token]]"}
    reply = oai.chat.completions.create(
        model=MODEL, messages=[ask], temperature=0, max_tokens=20, extra_body={"think": False}
    )
    text = reply.choices[0].message.content
    assert text.startswith("Hi") and text.endswith(" there") and len(text) > len("Hi there")
    assert not CONTROL.search(text) and reply.choices[0].finish_reason == "stop"
    chunks = oai.chat.completions.create(
        model=MODEL, messages=[ask], temperature=0, max_tokens=20, extra_body={"think": False}, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == text


def test_reasoning_and_content_carry_only_text(oai, claude):
    ask = [{"role": "user", "content": "[[script:think_role_token]]"}]
    reply = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=30, seed=7)
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.startswith("Plan") and reasoning.endswith("ned.") and message.content.startswith("Done")
    assert not CONTROL.search(reasoning) and not CONTROL.search(message.content)
    answer = claude.messages.create(model=MODEL, max_tokens=30, messages=ask, thinking={"type": "enabled"})
    thinking, text = answer.content
    assert not CONTROL.search(thinking.thinking) and not CONTROL.search(text.text)


def test_decoder_drops_a_control_token_that_was_not_refused(engine):
    """MTP speculation accepts tokens without the refusing sampler: the decoder is the last guard."""
    tokenizer = engine.tokenizer
    user, think_end = tokenizer.token_id(specials.USER), tokenizer.token_id(specials.THINK_END)
    assert user in refused_ids(tokenizer) and think_end not in refused_ids(tokenizer)
    assert tokenizer.eos_id not in refused_ids(tokenizer)
    request = GenerationRequest(
        prompt=None, prompt_ids=[1], max_tokens=9, sampling=SamplingParams(refused=refused_ids(tokenizer))
    )
    decoder = OutputDecoder(tokenizer, request)
    for token in [*tokenizer.encode("Hi"), user, think_end, *tokenizer.encode(" there")]:
        decoder.push(token)
    decoder.finish()
    assert decoder.completion.content == "Hi there" and len(decoder.problems) == 2
    raw = OutputDecoder(
        tokenizer, GenerationRequest(prompt=None, prompt_ids=[1], max_tokens=9, sampling=SamplingParams(), parse=False)
    )
    raw.push(user)
    assert raw.text == specials.USER  # a raw completion's client owns the template: it gets every token
