"""Reading a hook point's activations: what `steer build` averages and what `steer eval` measures.

Both insert one hook ahead of any steering, so they see each layer's sublayer output as it arrives
(shaped by the steering of earlier layers, not yet by this layer's). Values stay on the device
during a call and come to the host after it. A V4 hook is given the call's `Batch` (its rows may be
padded past the tokens); a V4.1 call holds one sequence's rows and no more, and gives none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from dwarfstar.backends.protocol import Backend
from dwarfstar.model.forward import Batch, HookPoint, Transformer
from dwarfstar.model.forward_v41 import Transformer41
from dwarfstar.prompt import render_conversation
from dwarfstar.quant.prompts import PromptText
from dwarfstar.sampling import SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.steering.apply import DeviceArrays, SteeredBackend, hookable, steering_of
from dwarfstar.steering.direction import SteeringScale, projection
from dwarfstar.tokenizer.tokenizer import Tokenizer


def prompt_ids(prompt: PromptText, tokenizer: Tokenizer, think: bool) -> list[int]:
    """A prompt in the chat template as one user turn (thinking or not); rendered text as it is."""
    if prompt.rendered:
        return tokenizer.encode_with_specials(prompt.text)
    rendered = render_conversation([{"role": "user", "content": prompt.text}], thinking=think)
    return tokenizer.encode_prompt(rendered.parts)


Probe = Callable[..., None]  # (layer, a sublayer's output, and V4's Batch) -> None


def last_row(out: Any, batch: Batch | None) -> Any:
    """A call's last token's row of a sublayer output, as a [1, dim] slice."""
    last = out.shape[0] if batch is None else batch.n_rows
    return out[last - 1 : last]


@contextmanager
def hooked(model: Transformer | Transformer41, point: HookPoint, hook: Probe) -> Iterator[None]:
    model.hooks[point].insert(0, hook)
    try:
        yield
    finally:
        model.hooks[point].remove(hook)


def last_row_activations(
    backend: Backend, point: HookPoint, prompts: Sequence[list[int]], on_prompt: Callable[[], None] | None = None
) -> torch.Tensor:
    """The component at each prompt's last row, every layer: float32 [n_prompts, n_layers, hidden]."""
    model = hookable(backend)
    arrays = DeviceArrays(model)
    rows: list[Any] = []

    def keep(il: int, out: Any, batch: Batch | None = None) -> None:
        rows.append(last_row(out, batch)[0])

    captured = []
    with hooked(model, point, keep):
        for ids in prompts:
            rows.clear()
            backend.forward(ids, backend.new_state(), all_logits=False)
            captured.append(torch.stack([arrays.to_host(r) for r in rows]))
            if on_prompt is not None:
                on_prompt()
    return torch.stack(captured)


@dataclass
class EvalResult:
    scale: float
    lengths: list[int] = field(default_factory=list)  # generated tokens per prompt (EOS not counted)
    # v . y at each prompt's last row (where the reply starts and where `build` measures), mean over
    # layers: `into` before each layer's own steering (what the earlier layers' steering left), `out`
    # after it (what the residual streams receive)
    into: list[float] = field(default_factory=list)
    out: list[float] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)

    @staticmethod
    def _mean(values: list[float]) -> float:
        return sum(values) / len(values)

    @property
    def mean_length(self) -> float:
        return self._mean(self.lengths)

    @property
    def mean_projection_in(self) -> float:
        return self._mean(self.into)

    @property
    def mean_projection_out(self) -> float:
        return self._mean(self.out)


def evaluate(
    backend: SteeredBackend,
    tokenizer: Tokenizer,
    prompts: Sequence[list[int]],
    scales: Sequence[float],
    max_tokens: int,
    on_prompt: Callable[[], None] | None = None,
) -> list[EvalResult]:
    """Greedy replies to every prompt at each scale of the direction's own component (the other at 0),
    with the component's projection on the direction where each reply starts."""
    steered = steering_of(backend)
    if steered is None:
        raise TypeError("evaluate needs a backend with a steering direction")
    point: HookPoint = steered.steering.direction.component  # type: ignore[assignment]
    model, rows = steered.model, steered.steering.rows
    arrays = DeviceArrays(model)
    # per layer, the projection of the last row of the latest call; the prompt's is read after its
    # prefill (multi-token calls run eagerly, so these Python-side writes happen on every backend)
    seen: dict[str, list[Any]] = {"in": [None] * model.args.n_layers, "out": [None] * model.args.n_layers}

    def recorder(side: str) -> Probe:
        def record(il: int, out: Any, batch: Batch | None = None) -> None:
            seen[side][il] = projection(last_row(out, batch), rows[il])

        return record

    def mean_of(side: str) -> float:
        return torch.cat([arrays.to_host(p) for p in seen[side]]).mean().item()

    eos = backend.args.eos_token_id
    greedy = SamplingParams(temperature=0.0)
    record_in, record_out = recorder("in"), recorder("out")
    results = []
    with hooked(model, point, record_in):
        model.hooks[point].append(record_out)  # after the steering hook
        try:
            for f in scales:
                scale = SteeringScale(ffn=f) if point == "ffn_out" else SteeringScale(attn=f)
                result = EvalResult(f)
                for ids in prompts:
                    session = Session(backend, ctx=len(ids) + max_tokens + 1)
                    steered.assign(session, scale)
                    session.prefill(ids)
                    result.into.append(mean_of("in"))
                    result.out.append(mean_of("out"))
                    reply = list(session.generate(max_tokens, greedy, stop_tokens=[eos]))
                    text_ids = reply[:-1] if reply and reply[-1] == eos else reply
                    result.lengths.append(len(text_ids))
                    result.samples.append(tokenizer.decode(text_ids))
                    if on_prompt is not None:
                        on_prompt()
                results.append(result)
        finally:
            model.hooks[point].remove(record_out)
    return results
