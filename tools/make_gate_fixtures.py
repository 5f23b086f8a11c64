"""Write the gate fixtures of a model from what the reference backend computes for it.

    .venv/bin/python tools/make_gate_fixtures.py [--model dwarfstar/data/nano.gguf] [--out tests/data/gates]

The official fixtures (ds4's vectors, its 30,000-token story with 16 assignments, a model that calls
tools) only mean something for DeepSeek V4 Flash. For the bundled nano model this writes what the
same gates then check, each from the reference backend (the numerical oracle):

- `nano.vec`: ds4's vector format for the prompts in `prompts/`, each step with our greedy token and
  the top tokens with their logprobs. Only tokens whose logit is strictly above the first one left out
  are written: the nano head gives every id outside the book one shared logit, and a tie at the
  boundary would make "in our top 20" depend on how a device orders equal values.
- `nano_long_prompt.txt` and `nano_long_facts.txt`: a rendered prompt of about 1,500 tokens of the
  book (past the raw window, ratio-128 compression and the indexer's top-16 selection), and 16
  phrases of three words spread over the reference's greedy continuation, which must all come back.
- `nano_tool_call.json`: the reply the reference gives to ds4's tool-call request through the server
  application (nano knows only its own `read`, `list` and `search` tools: asked for `list_files`, it
  starts a `search` call it does not finish, which the server ends as an invalid tool call, its text
  shown as content; the gate then checks that exact reply).

Run it again after retraining the bundled model; the tests in tests/evals run the gates on these files.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dwarfstar.engine.load import load_engine  # noqa: E402
from dwarfstar.engine.spec import EngineSpec  # noqa: E402
from dwarfstar.evals.long_context import run_long_context  # noqa: E402
from dwarfstar.evals.tool_call import ask_server, reply_of  # noqa: E402
from dwarfstar.evals.vectors import VECTOR_MAGIC, vector_prompt_ids  # noqa: E402
from dwarfstar.session.session import Session  # noqa: E402

CORPUS = ROOT.parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
VECTOR_PROMPTS = {
    "nano_lago": "Quel ramo del lago di Como",
    "nano_renzo": "Renzo e Lucia",
    "nano_curato": "Don Abbondio tornava a casa",
}
VECTOR_CTX, VECTOR_STEPS, VECTOR_TOP = 4096, 4, 20
LONG_CHARS_FROM, LONG_TOKENS = 400_000, 1500  # a passage from the middle of the book
LONG_CTX, LONG_GENERATE, LONG_MIN_PROMPT = 4096, 96, 1000  # the test runs the gate with these
LONG_SYSTEM = "Leggi il racconto e continua."
TOOL_CTX = 4096
PHRASES, PHRASE_WORDS = 16, 3


def vector_case(engine, name: str, prompt: str) -> list[str]:
    session = Session(engine.backend, ctx=VECTOR_CTX)
    session.prefill(vector_prompt_ids(engine, prompt))
    lines = [f"case {name} {VECTOR_CTX} {VECTOR_STEPS} prompts/{name}.txt"]
    for step in range(VECTOR_STEPS):
        logits = session.logits.float().flatten().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        values, ids = logits.topk(VECTOR_TOP + 1)
        kept = [int(t) for v, t in zip(values[:-1], ids[:-1], strict=True) if v > values[-1]]
        chosen = int(logits.argmax())
        lines.append(f"step {step} {engine.tokenizer.token_bytes(chosen).hex()} {len(kept)}")
        lines += [f"top {engine.tokenizer.token_bytes(t).hex()} {float(logprobs[t]):.6f}" for t in kept]
        session.decode(chosen)
    return [*lines, "end", ""]


def long_prompt(engine) -> str:
    text = CORPUS.read_text(encoding="utf-8")[LONG_CHARS_FROM:]
    ids = engine.tokenizer.encode(text)[:LONG_TOKENS]
    story = engine.tokenizer.decode(ids)
    return f"<｜begin▁of▁sentence｜>{LONG_SYSTEM}<｜User｜>{story}<｜Assistant｜></think>"


def phrases(text: str) -> list[str]:
    """Up to PHRASES distinct runs of PHRASE_WORDS words, each a verbatim piece of one line of `text`."""
    words = list(re.finditer(r"\S+", text))
    spans = [text[words[i].start() : words[i + PHRASE_WORDS - 1].end()] for i in range(len(words) - PHRASE_WORDS + 1)]
    spans = [s for s in spans if "\n" not in s]
    picked: list[str] = []
    for i in range(PHRASES):
        phrase = spans[i * (len(spans) - 1) // (PHRASES - 1)]
        if phrase not in picked:
            picked.append(phrase)
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "dwarfstar" / "data" / "nano.gguf")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "gates")
    args = parser.parse_args()
    (args.out / "prompts").mkdir(parents=True, exist_ok=True)
    engine = load_engine(EngineSpec(args.model, "reference", ctx=max(VECTOR_CTX, LONG_CTX, TOOL_CTX)))

    vec = [VECTOR_MAGIC, f"# {args.model.name}, reference backend: tools/make_gate_fixtures.py", ""]
    for name, prompt in VECTOR_PROMPTS.items():
        (args.out / "prompts" / f"{name}.txt").write_text(prompt, encoding="utf-8")
        vec += vector_case(engine, name, prompt)
    (args.out / "nano.vec").write_text("\n".join(vec), encoding="utf-8")

    prompt_file = args.out / "nano_long_prompt.txt"
    prompt_file.write_text(long_prompt(engine), encoding="utf-8")
    result = run_long_context(engine, prompt_file, [], LONG_CTX, LONG_GENERATE, LONG_MIN_PROMPT)
    facts = phrases(result.output)
    header = f"# phrases of the reference's greedy continuation ({result.prompt_tokens}-token prompt)"
    (args.out / "nano_long_facts.txt").write_text("\n".join([header, *facts]) + "\n", encoding="utf-8")

    reply = reply_of(ask_server(engine, TOOL_CTX))
    doc = {"model": args.model.name, "backend": "reference", "ctx": TOOL_CTX, "reply": reply}
    (args.out / "nano_tool_call.json").write_text(
        json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
    )
    print(f"wrote fixtures to {args.out}: {len(VECTOR_PROMPTS)} vectors, {len(facts)} phrases, tool reply")


if __name__ == "__main__":
    main()
