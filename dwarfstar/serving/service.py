"""What the routes share: the loaded engine, the worker, the session pool, tool memory, metrics, trace.

`submit_chat` and `submit_tokens` are the two ways a request reaches the model. Rendering and
tokenizing a long conversation takes a while, so both run it in a thread pool, never on the event
loop; the checks there (validation.py: the prompt and its output budget fit the context, the
conversation ends where the model answers) answer with a 400 before any stream starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from starlette.concurrency import run_in_threadpool

from dwarfstar.engine.images import PlacedImage, place
from dwarfstar.engine.load import Engine
from dwarfstar.errors import DwarfStarError
from dwarfstar.prompt.conversation import PromptError
from dwarfstar.prompt.dsml_guard import ToolGrammar
from dwarfstar.prompt.efforts import think_level_error
from dwarfstar.prompt.images import ImageError, ImagePart
from dwarfstar.prompt.render import Prompt, render_conversation
from dwarfstar.sampling import SamplingParams
from dwarfstar.serving.config import ServerConfig, session_memory_budget
from dwarfstar.serving.controls import Thinking, context_overflow, resolve_thinking
from dwarfstar.serving.disk import DiskCache
from dwarfstar.serving.errors import ApiError, bad_request
from dwarfstar.serving.fields import Fields
from dwarfstar.serving.generation import GenerationRequest
from dwarfstar.serving.images import Images
from dwarfstar.serving.jobs import Job
from dwarfstar.serving.metrics import Metric, Metrics, expert_collector
from dwarfstar.serving.models import ModelCatalog
from dwarfstar.serving.output import refused_ids
from dwarfstar.serving.pool import SessionPool
from dwarfstar.serving.replay import ToolMemory, apply_exact_replay, history_tool_ids, replay_reasoning
from dwarfstar.serving.request_trace import Trace
from dwarfstar.serving.scheduler import QueueFull, Scheduler, ShuttingDown
from dwarfstar.serving.validation import budget_overflow, nothing_to_answer, opens_answer
from dwarfstar.session.loopguard import LoopGuard, tool_loop, tool_loop_note
from dwarfstar.speculative.decode import load_speculation
from dwarfstar.steering.apply import steering_of
from dwarfstar.steering.direction import MAX_SCALE, SteeringScale


@dataclass
class Knobs:
    """What a dialect decided about a request besides its prompt."""

    api: str
    param: str  # the field that holds the prompt, named in a context-overflow error
    sampling: SamplingParams
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    tool_id_prefix: str = "call_"
    body: Any = None  # the client's request, for the trace


class Service:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        args = engine.backend.args
        if not 0 < config.ctx <= args.max_seq_len:
            raise DwarfStarError(f"--ctx {config.ctx} is outside 1..{args.max_seq_len} for this model")
        self.engine, self.config, self.tokenizer = engine, config, engine.tokenizer
        self.refused = refused_ids(engine.tokenizer)  # control tokens a templated answer never holds
        self.steered = steering_of(engine.backend)  # None unless started with --dir-steering-file
        # the server's template, with the effort table of the model's release
        self.options = replace(config.render_options, efforts=engine.model.args.reasoning_efforts)
        if config.think_level is not None and (problem := think_level_error(self.options.efforts, "--think-level")):
            raise DwarfStarError(problem)
        self.models = ModelCatalog(args, config.ctx, config.model_aliases)
        self.metrics = Metrics()
        if engine.experts is not None:  # --ssd-streaming: the expert cache's figures at each /metrics
            self.metrics.collectors.append(expert_collector(engine.experts))
        self.tool_memory = ToolMemory(config.tool_memory_ids)
        self.trace = Trace(config.trace) if config.trace else None
        self.disk = None
        if config.kv_disk_dir is not None:
            self.disk = DiskCache.open(
                config.kv_disk_dir,
                space_mb=config.kv_disk_space_mb,
                min_tokens=config.kv_cache_min_tokens,
                engine=engine,
                ctx=config.ctx,
                chunk=config.prefill_chunk,
                memory=self.tool_memory,
            )
        memory_bytes = (
            session_memory_budget(engine.entry) if config.kv_memory_mb is None else config.kv_memory_mb * 1024 * 1024
        )
        self.pool = SessionPool(
            engine.backend,
            engine.tokenizer,
            ctx=config.ctx,
            chunk=config.prefill_chunk,
            max_sessions=config.max_sessions,
            memory_bytes=memory_bytes,
            disk=self.disk,
        )
        self.scheduler = Scheduler(
            self.pool,
            engine.tokenizer,
            self.metrics,
            self.tool_memory,
            max_queue=config.max_queue,
            trace=self.trace,
            disk=self.disk,
            speculation=None if config.mtp is None else load_speculation(config.mtp, engine.backend, engine.model),
            experts=engine.experts,
            images=engine.images,
        )

    def thinking(self, model: str, switch: bool | None, effort: str | None, level: int | None = None) -> Thinking:
        """The request's thinking mode under this server's defaults (`--nothink`, `--think-level`) and context
        size; `level`: the request's `think_level`."""
        return resolve_thinking(
            default=self.config.think_by_default,
            model=model,
            switch=switch,
            effort=effort,
            ctx=self.config.ctx,
            release=self.options.efforts,
            level=level,
            default_level=self.config.think_level,
        )

    def images(self) -> Images:
        """A request's image reader: images are read with a vision encoder, URLs fetched with --allow-image-urls."""
        return Images(self.engine.vision, fetch=self.config.allow_image_urls)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()  # which queues the shutdown saves
        if self.disk is not None:
            self.disk.close()
        if self.trace is not None:
            self.trace.close()

    # -- requests --------------------------------------------------------------------------------------
    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        thinking: Thinking,
        *,
        param: str,
        response_format: Any = None,
    ) -> tuple[Prompt, list[str]]:
        """The conversation's prompt with exact DSML replay applied, and the tool-call ids replayed."""
        try:
            prompt = render_conversation(
                replay_reasoning(messages, self.tool_memory),
                tools=tools or None,
                response_format=response_format,
                thinking=thinking.enabled,
                reasoning_effort=thinking.renderer_effort,
                options=self.options,
            )
        except PromptError as exc:
            raise bad_request(str(exc), param=param) from None
        if self.disk is not None:
            self.disk.recall_tool_calls(history_tool_ids(messages))
        return apply_exact_replay(prompt, messages, self.tool_memory, self.options)

    def _ids(
        self, prompt: Prompt, images: Sequence[ImagePart], param: str
    ) -> tuple[list[int], tuple[PlacedImage, ...]]:
        """The prompt's ids, each image's slot replaced by its block (engine/images.py), and the images placed."""
        if not images:
            return self.tokenizer.encode_prompt(prompt.parts), ()
        try:
            ids, placed = place(self.engine.images.args, self.tokenizer, prompt.parts, images)
        except ImageError as exc:
            raise bad_request(f"{param}: {exc}", param=param) from None
        return ids, tuple(placed)

    async def count_chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None,
        thinking: Thinking,
        images: Sequence[ImagePart] = (),
    ) -> int:
        def count() -> int:
            prompt, _ = self._render(messages, tools, thinking, param="messages")
            return len(self._ids(prompt, images, "messages")[0])

        return await run_in_threadpool(count)

    async def submit_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None,
        thinking: Thinking,
        knobs: Knobs,
        response_format: Any = None,
        images: Sequence[ImagePart] = (),
    ) -> Job:
        """`images`: the request's images (serving/images.py), each with its slot in a message's text."""

        def prepare() -> tuple[GenerationRequest, list[str]]:
            guard = self._loop_guard(knobs.body)
            looped = None if guard is None else tool_loop(messages, guard.tool_turns)
            shown = messages
            if looped is not None and guard.tools == "note":
                shown = [*messages, {"role": "system", "content": tool_loop_note(looped, guard.tool_turns)}]
                self.metrics.inc(Metric.LOOP_GUARD_TOTAL, kind="tool_note")
            prompt, replayed = self._render(shown, tools, thinking, param=knobs.param, response_format=response_format)
            if not opens_answer(prompt):
                raise nothing_to_answer(knobs.api, messages, knobs.param)
            ids, placed = self._ids(prompt, images, knobs.param)
            request = self._request(prompt, ids, knobs, parse=True, thinking=thinking.enabled, tools=bool(tools))
            request.images = placed
            if tools and self._tool_guard(knobs.body):
                request.tool_grammar = ToolGrammar(tools, escaped=self.options.escape_dsml)
            if looped is not None:
                request.tool_loop = f"{looped} called the same way in {guard.tool_turns} assistant turns in a row"
                request.halted = guard.tools == "stop"
            return request, replayed

        request, replayed = await run_in_threadpool(prepare)
        return self._submit(request, replayed)

    async def submit_plain_chat(
        self, messages: Sequence[Mapping[str, Any]], *, thinking: Thinking, knobs: Knobs
    ) -> Job:
        """A conversation without tools or replay whose output is raw text (chat-wrapped completions)."""

        def prepare() -> GenerationRequest:
            try:
                prompt = render_conversation(
                    messages, thinking=thinking.enabled, reasoning_effort=thinking.renderer_effort, options=self.options
                )
            except PromptError as exc:
                raise bad_request(str(exc), param=knobs.param) from None
            ids = self.tokenizer.encode_prompt(prompt.parts)
            return self._request(prompt, ids, knobs, parse=False, thinking=False, tools=False)

        return self._submit(await run_in_threadpool(prepare), [])

    async def submit_tokens(
        self, prompt: Prompt | None, ids: list[int] | None, *, raw_text: str | None, knobs: Knobs
    ) -> Job:
        """A prompt given as rendered parts, token ids, or raw text (control-token strings matched)."""

        def prepare() -> GenerationRequest:
            if raw_text is not None:
                tokens = self.tokenizer.encode_with_specials(raw_text)
            elif ids is not None:
                tokens = ids
            else:
                tokens = self.tokenizer.encode_prompt(prompt.parts)
            return self._request(prompt, tokens, knobs, parse=False, thinking=False, tools=False, templated=False)

        return self._submit(await run_in_threadpool(prepare), [])

    def _request(
        self,
        prompt: Prompt | None,
        ids: list[int],
        knobs: Knobs,
        *,
        parse: bool,
        thinking: bool,
        tools: bool,
        templated: bool = True,
    ) -> GenerationRequest:
        """`templated`: rendered by this server, so control tokens other than an answer's are refused
        (output.py); a raw prompt's client owns its template and gets every token."""
        ctx = self.config.ctx
        if not ids:
            raise bad_request("the prompt is empty", param=knobs.param)
        if len(ids) >= ctx:
            raise context_overflow(len(ids), ctx, knobs.param)
        if knobs.max_tokens is not None and len(ids) + knobs.max_tokens > ctx:
            raise budget_overflow(knobs.api, len(ids), knobs.max_tokens, ctx, knobs.param)
        return GenerationRequest(
            prompt=prompt,
            prompt_ids=ids,
            max_tokens=knobs.max_tokens or ctx - len(ids),  # validation.py: given, it fits; else the rest
            sampling=replace(knobs.sampling, refused=self.refused) if templated else knobs.sampling,
            stop=knobs.stop,
            parse=parse,
            thinking=thinking,
            tools=tools,
            escaped_dsml=self.options.escape_dsml,
            tool_id_prefix=knobs.tool_id_prefix,
            api=knobs.api,
            trace_body=knobs.body,
            steering=self._steering(knobs.body),
            loop_guard=self._loop_guard(knobs.body),
        )

    def _loop_guard(self, body: Any) -> LoopGuard | None:
        """The request's loop guard: the extension field `loop_guard` (a boolean) turns it on, with the
        server's settings or the defaults, or off; without it, the server's (`--loop-guard`)."""
        asked = Fields(body if isinstance(body, Mapping) else {}).flag("loop_guard")
        if asked is None:
            return self.config.loop_guard
        return (self.config.loop_guard or LoopGuard()) if asked else None

    def _tool_guard(self, body: Any) -> bool:
        """Whether the tool-call guard keeps the request's DSML blocks to its tools: the extension field
        `tool_guard` (a boolean), else the server's (`--tool-guard`, on by default)."""
        asked = Fields(body if isinstance(body, Mapping) else {}).flag("tool_guard")
        return self.config.tool_guard if asked is None else asked

    def _steering(self, body: Any) -> SteeringScale | None:
        """The request's steering scales, extension fields `dir_steering_ffn` / `dir_steering_attn`
        (only on a server started with a direction file; the server's scales by default), as the KV
        cache key: None when nothing is steered."""
        fields = Fields(body if isinstance(body, Mapping) else {})
        ffn = fields.number("dir_steering_ffn", low=-MAX_SCALE, high=MAX_SCALE)
        attn = fields.number("dir_steering_attn", low=-MAX_SCALE, high=MAX_SCALE)
        if self.steered is None:
            if ffn is not None or attn is not None:
                name = "dir_steering_ffn" if ffn is not None else "dir_steering_attn"
                raise bad_request(f"{name} needs a server started with --dir-steering-file", param=name)
            return None
        default = self.steered.default
        scale = SteeringScale(default.ffn if ffn is None else ffn, default.attn if attn is None else attn)
        return None if scale.off else scale

    def _submit(self, request: GenerationRequest, replayed: list[str]) -> Job:
        job = Job(request, asyncio.get_running_loop(), replayed)
        try:
            self.scheduler.submit(job)
        except QueueFull:
            raise ApiError(
                429, f"server busy: {self.config.max_queue} requests are already waiting", code="rate_limit_exceeded"
            ) from None
        except ShuttingDown:
            raise ApiError(503, "server shutting down") from None
        self.metrics.inc(Metric.REQUESTS_TOTAL, api=request.api)
        return job
