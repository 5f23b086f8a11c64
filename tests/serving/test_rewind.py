"""A prompt that is a strict prefix of a live KV (an earlier turn asked again, as a client does when
it regenerates or edits) is served by cutting the live state back, not by prefilling it again."""

from __future__ import annotations

NOTHINK = {"thinking": {"type": "disabled"}}
FIRST = "Remember this long story. " + "The lake lies between mountains and the town. " * 40  # ~450 tokens


def ask(oai, messages):
    return oai.chat.completions.create(
        model="deepseek-v4-flash", messages=messages, temperature=0, max_tokens=4, extra_body=NOTHINK
    )


def test_a_prompt_that_is_a_strict_prefix_of_a_live_kv_rewinds_it(oai, server):
    opening = [{"role": "system", "content": "Rewind test."}, {"role": "user", "content": FIRST}]
    first = ask(oai, opening)
    later = opening + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    ask(oai, later)  # the live KV now holds the opening, the answer and the second turn
    prefilled = server.metric("dwarfstar_prefill_tokens_total")
    again = ask(oai, opening)  # the opening alone: every token of it is in the live KV
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert server.metric("dwarfstar_prefill_tokens_total") == prefilled  # nothing prefilled again
    assert again.choices[0].message.content == first.choices[0].message.content  # the same state as before


def test_a_system_prompt_changing_in_one_spot_keeps_the_prefix_before_it(oai, server):
    """A date line in the middle of the system prompt: what precedes it is reused and only the rest is
    prefilled (the KV after a changed token depends on it, so no exact cache can keep that part).
    The kept part is cut back from a chunk checkpoint, so at least one prefill chunk (256 tokens
    here, 4096 by default) must precede the spot; a shorter shared prefix costs a cold prefill anyway."""
    rules = "Follow the house rules carefully. " * 90  # about 540 tokens: two chunks
    tools = "You may call tools when needed. " * 30

    def system(date: str) -> list[dict]:
        return [{"role": "system", "content": f"{rules}\nToday is {date}.\n{tools}"}, {"role": "user", "content": "Hi"}]

    ask(oai, system("2026-12-01 11:00:00"))
    before = ask(oai, system("2026-12-01 11:00:00"))  # unchanged: a full hit
    changed = ask(oai, system("2026-12-01 11:00:07"))
    cached, total = changed.usage.prompt_tokens_details.cached_tokens, changed.usage.prompt_tokens
    assert before.usage.prompt_tokens_details.cached_tokens == before.usage.prompt_tokens
    assert 256 <= cached < total  # the rules before the date line are kept, to a chunk boundary
    print(f"volatile spot: {cached} of {total} prompt tokens reused ({cached / total:.0%})")
