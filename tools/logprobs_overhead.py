"""What asking for logprobs costs a decode: tok/s of greedy decoding on the bundled model without
logprobs and with top-20 alternatives, the two interleaved in one process (issue 35's figure).

    .venv/bin/python tools/logprobs_overhead.py [--backend reference] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path
from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.session.session import Session, decode_batch, sample_next

PROMPT = "Quel ramo del lago di Como, che volge a mezzogiorno"


def rate(engine, ids: list[int], logprobs: int | None, tokens: int) -> float:
    session = Session(engine.backend, ctx=len(ids) + tokens + 1)
    session.prefill(ids)
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=logprobs))
    token = sample_next([session], [sampler])[0]
    start = time.perf_counter()
    for _ in range(tokens):
        token = decode_batch([session], [token], [sampler])[0]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = load_engine(EngineSpec(default_model_path(), args.backend, ctx=4096))
    ids = engine.tokenizer.encode(PROMPT)
    rates: dict[int | None, list[float]] = {None: [], 20: []}
    for _ in range(args.rounds):
        for logprobs in rates:
            rates[logprobs].append(rate(engine, ids, logprobs, args.tokens))
    for logprobs, seen in rates.items():
        label = "without logprobs" if logprobs is None else f"top_logprobs={logprobs}"
        print(f"{label:>18}: {' / '.join(f'{r:.1f}' for r in seen)} tok/s ({args.tokens} tokens, {args.backend})")
    ratio = sum(rates[20]) / sum(rates[None])
    print(f"with / without: {ratio:.3f}")


if __name__ == "__main__":
    main()
