"""Request knobs every API shares: thinking mode, sampling, stop strings and the output budget.

Thinking (DS4_SURFACE §2.4). The server default is on unless `--nothink`. The model name
`deepseek-chat` turns it off and `deepseek-reasoner` on; an explicit switch (`thinking`, `think`,
`enable_thinking`) wins over both. Effort `none` turns it off; the other effort names (`max`, `xhigh`,
`high`, `medium`, `low`, `minimal`) choose the preamble of the model's release (prompt/efforts.py: for
the preview only `max`, Think-Max, has one; for Flash 0731 and PRO 0813 `high` and `max` do; `max`
needs a context of at least 393,216 tokens, as in ds4) but do not switch thinking on, so a `--nothink`
server stays without thinking for clients that always send an effort (Codex). On a V4.1 model the
effort is a think level (1..100; the names are its presets low 50, high 75, max 100), which a request
may also give as a number in `think_level`, a DwarfStar extension (ds4's `--think-level`): 0 turns
thinking off and 1..100 on, whatever the other fields say; on a V4 model it is a 400. Without either,
a V4.1 request thinks at `serve --think-level`, else 75.

Sampling (§2.5): temperature 1, top_p 1, min_p 0.05, top_k 0 unless given. While thinking, ds4 resets
all four to those defaults, since the model reasons badly at low temperature; so greedy, reproducible
output needs thinking off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dwarfstar.errors import DwarfStarError
from dwarfstar.prompt.efforts import MAX_THINK_LEVEL, Effort, effort_level, think_level_error
from dwarfstar.sampling import SamplingParams
from dwarfstar.serving.errors import ApiError, bad_request
from dwarfstar.serving.fields import Fields

EFFORTS = ("max", "xhigh", "high", "medium", "low", "minimal", "none")
NO_THINKING_MODEL = "deepseek-chat"
THINKING_MODEL = "deepseek-reasoner"
MAX_STOP_STRINGS = 16
THINK_LEVEL = "think_level"  # the request field of a V4.1 think level (a DwarfStar extension)


@dataclass(frozen=True)
class Thinking:
    enabled: bool
    effort: Effort = None  # the renderer's effort level (prompt/efforts.py); None: the release's default

    @property
    def renderer_effort(self) -> Effort:
        return self.effort if self.enabled else None


def thinking_switch(fields: Fields, key: str) -> bool | None:
    """`true`/`false`, or an object `{"type": "enabled"|"adaptive"|"disabled"}`; None when absent."""
    value = fields.raw(key)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, dict):
        kind = value.get("type")
        if kind in ("enabled", "adaptive"):
            return True
        if kind == "disabled":
            return False
    raise bad_request(f'{fields.where}{key} must be a boolean or {{"type": "enabled"|"disabled"}}', param=key)


def effort_value(fields: Fields, key: str) -> str | None:
    effort = fields.text(key)
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"{fields.where}{key} must be one of {', '.join(EFFORTS)}, got {effort!r}", param=key)
    return effort


def think_level_value(fields: Fields) -> int | None:
    """The request's `think_level` (0..MAX_THINK_LEVEL; None when absent)."""
    return fields.integer(THINK_LEVEL, low=0, high=MAX_THINK_LEVEL)


def resolve_thinking(
    *,
    default: bool,
    model: str,
    switch: bool | None,
    effort: str | None,
    ctx: int,
    release: str,
    level: int | None = None,
    default_level: int | None = None,
) -> Thinking:
    """Whether the request thinks, and at which of its model's `release` effort levels; `level`: its
    `think_level`, `default_level`: the server's `--think-level` (both V4.1 only)."""
    if level is not None and (problem := think_level_error(release, THINK_LEVEL)):
        raise bad_request(problem, param=THINK_LEVEL)
    enabled = default
    if model == NO_THINKING_MODEL:
        enabled = False
    elif model == THINKING_MODEL:
        enabled = True
    if switch is not None:
        enabled = switch
    if effort == "none":
        enabled = False
    if level is not None:
        enabled = level > 0
    if not enabled:
        return Thinking(False)
    if level or effort or not default_level:
        return Thinking(True, level or effort_level(release, effort, ctx))
    return Thinking(True, default_level)


def sampling_params(
    fields: Fields, thinking: Thinking, *, top_k: bool = True, min_p: bool = True, seed: bool = True
) -> SamplingParams:
    """The request's sampling knobs (those its API has), checked; ds4's thinking-mode reset applied."""
    temperature = fields.number("temperature", low=0.0, high=2.0)
    top_p = fields.number("top_p", low=0.0, high=1.0)
    k = fields.integer("top_k", low=-1) if top_k else None  # -1 is "no cap" for some clients
    p = fields.number("min_p", low=0.0, high=1.0) if min_p else None
    s = fields.integer("seed", low=-(2**63), high=2**63 - 1) if seed else None
    seed_value = s if s is not None and s > 0 else None  # ds4: a seed <= 0 means a fresh one
    if thinking.enabled:
        return SamplingParams(seed=seed_value)
    defaults = SamplingParams()
    try:
        return SamplingParams(
            temperature=defaults.temperature if temperature is None else temperature,
            top_k=max(0, k) if k is not None else defaults.top_k,
            top_p=defaults.top_p if top_p is None else top_p,
            min_p=defaults.min_p if p is None else p,
            seed=seed_value,
        )
    except DwarfStarError as exc:
        raise bad_request(str(exc)) from None


def stop_strings(fields: Fields, key: str) -> tuple[str, ...]:
    value = fields.raw(key)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request(f"{fields.where}{key} must be a string or an array of strings", param=key)
    if len(value) > MAX_STOP_STRINGS:
        raise bad_request(f"{fields.where}{key} holds more than {MAX_STOP_STRINGS} strings", param=key)
    return tuple(s for s in value if s)


def structured_format(fields: Fields | None, key: str) -> dict[str, Any] | None:
    """The output format at `key` (chat's `response_format`, Responses' `text.format`) as the renderer
    takes it: None when absent or plain `{"type": "text"}`."""
    spec = fields.mapping(key) if fields is not None else None
    return spec.body if spec is not None and spec.raw("type") != "text" else None


def output_budget(fields: Fields, *keys: str) -> int | None:
    """The first of `keys` that is set; whether it fits the context with the prompt is checked once the
    prompt is tokenized (validation.py, `context`)."""
    for key in keys:
        value = fields.integer(key, low=1)
        if value is not None:
            return value
    return None


def context_overflow(n_prompt: int, ctx: int, param: str) -> ApiError:
    return ApiError(
        400,
        f"Prompt has {n_prompt} tokens, but the configured context size is {ctx} tokens",
        param=param,
        code="context_length_exceeded",
        extra={"n_prompt_tokens": n_prompt, "n_ctx": ctx},
    )
