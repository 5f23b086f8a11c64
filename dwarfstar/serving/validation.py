"""What the API endpoints refuse before any job is queued: each rule, its source, and the checks they share.

A refused request is answered in its API's error shape (errors.py): OpenAI's
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}`, Anthropic's
`{"type": "error", "error": {"type": "invalid_request_error", "message"}}`. Every check runs while the
request is read, rendered or tokenized, before `Service` submits a job, so a refusal leaves nothing in
the scheduler. tests/serving/test_validation.py tests each rule through HTTP (status, error shape, no
job in `/metrics`); the test that covers a rule is named after it.

Chat Completions (https://platform.openai.com/docs/api-reference/chat/create):
- `empty`: `messages` is a non-empty array ("A list of messages comprising the conversation so far").
- `role`: every message has a role, one of `developer`, `system`, `user`, `assistant`, `tool`, and
  `function` (deprecated by OpenAI, read as `tool`), plus DeepSeek's `latest_reminder`, which the
  renderer knows (conversation.py). ds4 drops unknown roles and reads a missing one as `user`; here
  both are refused, as `dwarfstar render` refuses them.
- `tool_choice`: "`none` is the default when no tools are present"; `required` or a named function
  with no tools is refused (OpenAI: "'tool_choice' is only allowed when 'tools' are specified"), and
  a named function must be one of `tools`. With tools, `required` and a named function are accepted
  but not enforced: the model is offered the tools and chooses, as under `auto`.
- `n`: "How many chat completion choices to generate"; only 1 is served.
- `context`: the prompt plus `max_completion_tokens` (or the deprecated `max_tokens`) must fit the
  context (`--ctx`): OpenAI answers 400 `context_length_exceeded`, "This model's maximum context
  length is N tokens. However, you requested ...", and so does this server, naming the limit. Without
  either field the output may fill the rest of the context (ds4's default), the only capping left.
- `media`: an `image_url` part is read (serving/images.py: a base64 data URL, at most 16 a request,
  decoded, a corrupt one refused naming its part), in a tool result too, and refused while the model
  has no vision encoder (`serve --vision`): a silently dropped image makes the model answer about a
  picture it never saw. `input_audio`, `file` and other part types than text are refused. Without a
  vision encoder, an image inside a tool result (an agent's read of an image file), like any other
  non-text part there, becomes the text `[Unsupported TYPE]` instead, as the DeepSeek V4 encoder
  writes a tool message's non-text part, so the agent's session goes on and the model knows what it
  did not get; a refusal there would fail every later request of that conversation.
- `answer`: the conversation ends where the model can answer: after a user, tool or developer
  message (a system message may follow them). A conversation that ends with an assistant message,
  or holds only system messages, would render a prompt with no `<｜Assistant｜>` opener; the model
  then writes the next user turn itself.

- `logprobs`: a boolean; `top_logprobs` an integer 0–20 ("An integer between 0 and 20") that needs
  `logprobs: true` ("logprobs must be set to true if this parameter is used"). serving/logprobs.py.

Completions (https://platform.openai.com/docs/api-reference/completions/create): `n` and `context`
as above, with `max_tokens`; `logprobs` an integer 0–20 (OpenAI's own limit is 5; 20 as for chat).

Responses (https://platform.openai.com/docs/api-reference/responses/create), the same checks on
`input`: `empty` (a string, or a non-empty array of items), `role` (a message item's role is `user`,
`system`, `developer` or `assistant`), `tool_choice` (as above; with tools, only `auto` and `none` are
served, as ds4 serves them), `context` with `max_output_tokens`, `media` (`input_image` read as above, its
`file_id` refused; `input_file`, `input_audio` refused; in a `function_call_output`, an image read as above
and another part `[Unsupported TYPE]`) and `answer`;
`top_logprobs` 0–20, which needs `include: ["message.output_text.logprobs"]` (the field that asks).

Messages (https://platform.claude.com/docs/en/api/messages):
- `max_tokens`: required ("The maximum number of tokens to generate before stopping"); count_tokens
  does not take it.
- `empty`: `messages` is a non-empty array.
- `role`: `user` or `assistant` ("Our models are trained to operate on alternating user and
  assistant conversational turns"), and `system` entries as Claude Code puts them in `messages`.
- `merge`: "Consecutive user or assistant turns in your request will be combined into a single
  turn": their content blocks are read as one message's, the texts of the messages joined by a blank
  line, as the DeepSeek V4 encoder joins user turns it merges.
- `tool_choice`: `{"type": "any"}` or `{"type": "tool", "name"}` need tools, and the named tool must
  be one of them ("any tells Claude that it must use one of the provided tools",
  https://platform.claude.com/cookbook/tool-use-tool-choice);
  `{"type": "none"}` offers none.
- `context`: the prompt plus `max_tokens` must fit the context; the message is Anthropic's, "input
  length and `max_tokens` exceed context limit: P + M > N, decrease input length or `max_tokens` and
  try again", which Claude Code reads to retry with a `max_tokens` that fits.
- `media`: `image` blocks are read as above (a `base64` source; a `url` source is refused), inside a
  `tool_result` too, and `document` blocks refused; inside a `tool_result`, a block other than text
  and images is `[Unsupported TYPE]`, as above.
- `answer`: a last `assistant` message (a prefill) is refused with the message Claude 4.6 and later
  models answer ("This model does not support assistant message prefill. The conversation must end
  with a user message.", https://platform.claude.com/docs/en/about-claude/models/whats-new-claude-4-6).

Every generation request: the DwarfStar extensions `loop_guard` (session/loopguard.py) and `tool_guard`
(prompt/dsml_guard.py) are booleans.

Every route: a method the route does not serve is a 405 `invalid_request_error` with an `Allow`
header (OpenAI answers `GET /v1/chat/completions` with "Invalid method for URL (GET ...)").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dwarfstar.prompt.render import Prompt
from dwarfstar.serving.errors import ApiError, bad_request
from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.specials import TASK_TOKENS, Control

NO_VISION = "this server has no vision encoder: start it with --vision FILE (a vision encoder GGUF), or send text only"
PREFILL = "This model does not support assistant message prefill. The conversation must end with a user message."
_OPENERS = {specials.THINK_START, specials.THINK_END}
_TASKS = set(TASK_TOKENS.values())


def non_empty(items: Any, param: str) -> list[Any]:
    """`items` (already known to be an array or None), refused when missing or empty."""
    if items is None:
        raise bad_request(f"missing {param}", param=param)
    if not items:
        raise bad_request(f"{param} must not be empty: it holds the conversation the model answers", param=param)
    return items


def unknown_role(role: Any, where: str, roles: Sequence[str]) -> ApiError:
    what = f"has the unknown role {role!r}" if role is not None else "has no role"
    return bad_request(f"{where} {what}; the roles are {', '.join(roles)}", param=f"{where}.role")


def media_refused(kind: Any, where: str) -> ApiError:
    """A content part or block this server cannot read: audio, a file, an image of another API's type."""
    return bad_request(f"{where}: content of type {kind!r} is not supported; send text", param=where)


def unsupported_part(kind: Any) -> str:
    """The DeepSeek V4 encoder's text for a tool result's part that is not text (`[Unsupported image]`)."""
    return f"[Unsupported {kind}]"


def check_tool_choice(choice: Any, names: Sequence[str], *, named: str | None, needs_tools: bool) -> None:
    """`needs_tools`: the choice asks for a call (OpenAI `required`, Anthropic `any`, or a name), which
    tools must back; `named`: the one tool it forces, which must be among `names`."""
    if needs_tools and not names:
        raise bad_request(f"tool_choice {choice!r} needs tools, and the request offers none", param="tool_choice")
    if named is not None and named not in names:
        offered = ", ".join(repr(n) for n in names)
        raise bad_request(f"tool_choice names {named!r}, which is not among the tools ({offered})", param="tool_choice")


def budget_overflow(api: str, n_prompt: int, max_tokens: int, ctx: int, param: str) -> ApiError:
    """Prompt plus requested output over the context, in the wording of the request's API."""
    extra = {"n_prompt_tokens": n_prompt, "n_ctx": ctx}
    if api == "messages":
        message = (
            f"input length and `max_tokens` exceed context limit: {n_prompt} + {max_tokens} > {ctx}, "
            "decrease input length or `max_tokens` and try again"
        )
        return ApiError(400, message, param="max_tokens", code="context_length_exceeded", extra=extra)
    message = (
        f"This model's maximum context length is {ctx} tokens. However, you requested {n_prompt + max_tokens} "
        f"tokens ({n_prompt} in the {param}, {max_tokens} in the completion). Please reduce the length of the "
        f"{param} or completion."
    )
    return ApiError(400, message, param=param, code="context_length_exceeded", extra=extra)


def opens_answer(prompt: Prompt) -> bool:
    """Whether a rendered prompt ends where the model answers: `<｜Assistant｜>` and its thinking
    marker, or a quick-instruction task token."""
    parts = prompt.parts
    last = parts[-1] if parts else None
    if isinstance(last, Control) and last.text in _TASKS:
        return True
    before = parts[-2] if len(parts) > 1 else None
    return (
        isinstance(last, Control)
        and last.text in _OPENERS
        and isinstance(before, Control)
        and before.text == specials.ASSISTANT
    )


def nothing_to_answer(api: str, messages: Sequence[Mapping[str, Any]], param: str) -> ApiError:
    last = next((m.get("role") for m in reversed(messages) if m.get("role") != "system"), None)
    if api == "messages" and last == "assistant":
        return bad_request(PREFILL, param=param)
    ending = f"ends with a message of role {last!r}" if last else "holds no user message"
    return bad_request(
        f"the conversation {ending}: there is nothing for the model to answer "
        "(it must end with a user or tool message; assistant prefill is not supported)",
        param=param,
    )
