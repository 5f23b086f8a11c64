"""`POST /v1/completions`: OpenAI legacy completions, chat-wrapped as ds4 does, or raw.

Chat-wrapped (default, DS4_SURFACE §3.5): the prompt becomes the user turn after the fixed system
prompt "You are a helpful assistant", thinking as for chat; the output is the raw generated text
(reasoning and `</think>` included). Raw (`"raw": true`, a DwarfStar extension asked for in ds4 #61):
the prompt text is tokenized as is, control-token strings matched as control tokens and no BOS
added, or given directly as an array of token ids; the client owns the template (FIM, base-model
use, its own chat format). Neither offers tools nor parses DSML: a tool-call block, readable or not,
is text like any other (an invalid tool call is a chat API's matter: openai_chat.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from dwarfstar.prompt.dsml_parser import ContentDelta
from dwarfstar.serving.controls import (
    Thinking,
    effort_value,
    output_budget,
    sampling_params,
    stop_strings,
    think_level_value,
    thinking_switch,
)
from dwarfstar.serving.errors import bad_request
from dwarfstar.serving.fields import Fields, read_json_object
from dwarfstar.serving.generation import Event, Failed, Finished, TokenLogprob, new_id
from dwarfstar.serving.logprobs import Pending, completion_block, completion_logprobs
from dwarfstar.serving.openai_chat import envelope, openai_finish, stream_error, usage_chunk, usage_object
from dwarfstar.serving.service import Knobs, Service
from dwarfstar.serving.sse import respond, sse

WRAP_SYSTEM = "You are a helpful assistant"


def _prompt(fields: Fields, vocab_size: int) -> str | list[int]:
    prompt = fields.required("prompt", fields.raw("prompt"))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"prompt token {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
        return prompt
    raise bad_request("prompt must be a string, an array of token ids, or an array holding one of them", "prompt")


async def completions(request: Request) -> Response:
    service: Service = request.app.state.service
    fields = await read_json_object(request)
    model = service.models.resolve(fields.text("model"))
    prompt = _prompt(fields, service.tokenizer.vocab_size)
    raw = bool(fields.flag("raw"))
    if (fields.integer("n", low=1) or 1) != 1:
        raise bad_request("n must be 1: one choice per request", param="n")
    if isinstance(prompt, list) and not raw:
        raise bad_request('a prompt of token ids needs "raw": true (it is not wrapped in the chat template)', "prompt")
    switch = thinking_switch(fields, "thinking")
    if fields.flag("think") is not None:
        switch = fields.flag("think")
    thinking = service.thinking(model, switch, effort_value(fields, "reasoning_effort"), think_level_value(fields))
    knobs = Knobs(
        api="completions",
        param="prompt",
        sampling=replace(
            sampling_params(fields, Thinking(False) if raw else thinking), logprobs=completion_logprobs(fields)
        ),
        max_tokens=output_budget(fields, "max_tokens"),
        stop=stop_strings(fields, "stop"),
        body=fields.body,
    )
    include_usage = usage_chunk(fields)
    stream = bool(fields.flag("stream"))  # every field is read before the job exists, so a 400 leaves none
    if raw:
        ids = prompt if isinstance(prompt, list) else None
        text = prompt if isinstance(prompt, str) else None
        job = await service.submit_tokens(None, ids, raw_text=text, knobs=knobs)
    else:
        wrapped = [{"role": "system", "content": WRAP_SYSTEM}, {"role": "user", "content": prompt}]
        job = await service.submit_plain_chat(wrapped, thinking=thinking, knobs=knobs)
    response_id = new_id("cmpl-")
    writer = partial(CompletionStream, response_id, model, include_usage)
    return await respond(job, request, stream, writer, partial(completion, response_id, model))


def completion(response_id: str, model: str, outcome: Finished) -> dict[str, Any]:
    logprobs = None if outcome.logprobs is None else completion_block(outcome.logprobs)
    choice = {"text": outcome.text, "index": 0, "logprobs": logprobs, "finish_reason": openai_finish(outcome.reason)}
    created = int(time.time())
    return envelope("text_completion", response_id, created, model, [choice], usage=usage_object(outcome.usage))


class CompletionStream:
    def __init__(self, response_id: str, model: str, include_usage: bool) -> None:
        self.id, self.model, self.include_usage = response_id, model, include_usage
        self.created = int(time.time())
        self.pending = Pending()  # logprobs of tokens whose text has not been sent yet
        self.offset = 0  # the text length of the tokens whose logprobs were sent

    def _chunk(self, choices: list[Any], **extra: Any) -> bytes:
        return sse(envelope("text_completion", self.id, self.created, self.model, choices, **extra))

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        entries, logprobs = self.pending.take(), None
        if entries:
            logprobs = completion_block(entries, self.offset)
            self.offset += sum(len(e.token) for e in entries)
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}

    def __call__(self, event: Event) -> list[bytes]:
        if isinstance(event, TokenLogprob):
            self.pending.entries.append(event)
            return []
        if isinstance(event, ContentDelta):
            return [self._chunk([self._choice(event.text, None)])]
        if isinstance(event, Finished):
            out = [self._chunk([self._choice("", openai_finish(event.reason))])]
            if self.include_usage:
                out.append(self._chunk([], usage=usage_object(event.usage)))
            return out + [b"data: [DONE]\n\n"]
        if isinstance(event, Failed):
            return stream_error(event.message)
        return []
