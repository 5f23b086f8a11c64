"""Train the bundled nano model: the DeepSeek V4 architecture at toy size, on I promessi sposi, on the CPU.

    .venv/bin/python tools/train_nano.py [--steps N] [--seed S] [--out dwarfstar/data/nano.gguf]
    .venv/bin/python tools/train_nano.py --init dwarfstar/data/nano.gguf --steps N --lr LR   # warm start
    # issue 19's tool run (45 min on the shared 2-core machine; book perplexity 74.46, 52 of 60
    # held-out requests call the right tool, none copies a held-out argument word; its requests
    # had the argument bare, which no call can copy token for token, see chat_data.TRAIN_TEMPLATES):
    .venv/bin/python tools/train_nano.py --init dwarfstar/data/nano.gguf --steps 280 --lr 2e-3 --batch 4 \
        --tool-batch 20 --call-weight 5 --tool-evals 10 --eval-every 70 --out build/nano/nano.gguf
    # a copy probe (quoted arguments; calls with invented arguments, synthetic copy runs, the
    # argument's loss weighted): teacher-forced held-out arguments are logged at each evaluation
    .venv/bin/python tools/train_nano.py --init dwarfstar/data/nano.gguf --steps 150 --lr 3e-3 --batch 2 \
        --tool-batch 4 --call-batch 24 --copy-batch 16 --call-weight 2 --arg-weight 5 --tool-evals 0 \
        --eval-every 25 --workdir build/probe --out build/probe/nano.gguf
    # the bundled file: from scratch, the copy circuit and its finding head planted
    # (dwarfstar/train/induction.py), about 41 min; README "Model" has its figures
    .venv/bin/python tools/train_nano.py --out build/nano/nano.gguf --f32-out build/nano/nano-f32.gguf
    # issue 36's decision run (23 min): the tools prompts' turns as the agent turns are (a reasoning
    # sentence, greetings answered without a call), the first reply token weighted 8, warm from the
    # run before it (build/agent5, 300 steps with 2 agent turns a step); its figures are in the
    # issue-36 closing note. Not the bundled file: its book perplexity is over the 5% bound
    .venv/bin/python tools/train_nano.py --init build/agent5/nano.gguf --steps 350 --lr 3e-4 --tool-batch 8 \
        --tool-thinking 0.8 --tool-reasoning --tool-greetings 0.5 --call-batch 2 --decision-weight 8 \
        --agent-batch 0 --eval-every 350 --workdir build/agent6 --out build/agent6/nano.gguf
    # issue 36's runs 9a-9c (README "Model" has their figures): 9b as here (25 min), 9a with
    # --agent-autograd (three times the step time), 9c without --tool-reasoning, 200 steps
    .venv/bin/python tools/train_nano.py --init dwarfstar/data/nano.gguf --steps 150 --lr 3e-4 --tool-batch 8 \
        --tool-thinking 0.7 --tool-reasoning --tool-greetings 0.5 --call-batch 2 --call-weight 3 \
        --decision-weight 8 --agent-batch 2 --agent-prompts 90 --agent-tokens 1500 3000 --agent-pool 10 \
        --agent-refresh 1 --agent-evals 6 --tool-evals 10 --eval-every 50 --workdir build/agent9b \
        --out build/agent9b/nano.gguf
    # issue 36's run 10a (17 min): the greeting decision on the short tools prompts, empty reasoning
    # (README "Model" has the figures of runs 10 and 11); 11a-11c continue from it with agent turns:
    # 11a `--lr 4e-4 --batch 8 --agent-batch 2 --agent-prompts 90 --agent-pool 10 --agent-tokens 1500
    # 3000 --agent-refresh 1 --steps 200` (38 min), 11b the same on 3000-8000 tokens with
    # `--agent-refresh 4` (68 min), 11c `--tool-batch 4 --agent-batch 8 --agent-pool 20 --steps 150`
    .venv/bin/python tools/train_nano.py --init dwarfstar/data/nano.gguf --steps 150 --lr 1e-3 --tool-batch 8 \
        --tool-thinking 0.7 --tool-greetings 0.5 --call-batch 2 --call-weight 3 --decision-weight 8 \
        --agent-batch 0 --tool-evals 6 --eval-every 75 --workdir build/decA --out build/decA/nano.gguf
    # issue 36's run 13a (37 min; README "Model" has the figures of runs 12 and 13): from the bundled file,
    # agent turns from step 0, half the short prompts with the clients' own tools, composed greetings;
    # 13b adds --tool-autograd (51 min); 12a (agD1) and 12b (agD2) are 13a for 200 steps without
    # --composed-greetings, 12a without --tool-client
    .venv/bin/python tools/train_nano.py --init dwarfstar/data/nano.gguf --steps 150 --lr 1e-3 --batch 8 \
        --tool-batch 8 --tool-thinking 0.7 --tool-greetings 0.5 --tool-client 0.5 --composed-greetings \
        --call-batch 2 --call-weight 3 --decision-weight 8 --agent-batch 2 --agent-prompts 90 \
        --agent-tokens 1500 3000 --agent-pool 10 --agent-refresh 1 --agent-evals 6 --tool-evals 6 \
        --eval-every 150 --workdir build/agEa --out build/agEa/nano.gguf
    # issue 36's run 14a (55 min) is 13a with twelve agent turns a step, half of them greetings:
    # `--steps 200 --agent-batch 12 --agent-pool 30 --agent-greetings 0.5 --eval-every 100`; 14b the
    # same on 3000-6000-token prompts with `--agent-refresh 2` (90 min)
    # runs 15a/15b (warm from 14a, `--lr 4e-4 --agent-greetings 0.3`, 15b `--call-weight 6 --arg-weight 6`;
    # 44 min) and 16a/16b (14a with `--agent-prompts 180` or `--agent-noise 0.3`; 46 and 40 min) did not
    # improve on it: README "Model"; run 17 is 14a's recipe (17b `--seed 1`, 42 min) after the shell
    # commands began quoting the argument as the request does; run 19 adds `--tool-bare 0.5` (19b also
    # `--call-batch 12`, 57 min), run 20 continues 19b on bare calls alone (`--batch 2 --tool-batch 4
    # --tool-bare 1.0 --call-batch 24 --agent-batch 0`): no bare argument learned (README "Model")
    # run 21a (98 min with another run on the second core): from scratch with half the short requests bare,
    # the bare finder and twin codes planted (dwarfstar/train/induction.py); 21b adds --no-bare-find-init
    .venv/bin/python tools/train_nano.py --tool-bare 0.5 --eval-every 200 --workdir build/bareA \
        --out build/bareA/nano.gguf
    # runs 21c-21h: 21a's command read at its step-200 evaluation (README "Model"); 21c adds --call-batch 10, 21g is
    # 21b with --seed 1; 21d-21f and 21h changed CopyInit's planting for the run (a driver outside the repository);
    # 21i-21n add --twins free, --twins arguments or --name-weight 8 (21n to 21b), 21j and 21l also --seed 1
    # run 22 (79 min beside other runs; README "Model"): run 14a's command (run 17's recipe) warm from 21a with
    # `--init build/bareA/nano.gguf --tool-bare 0.5 --workdir build/agM --out build/agM/nano.gguf`
    .venv/bin/python tools/train_nano.py --twin-k   # the 256-wide twin, written under build/
    .venv/bin/python tools/train_nano.py --mtp [--mtp-steps N] [--mtp-out dwarfstar/data/nano-mtp.gguf]
    # the bundled DSpark drafter (89 min on one core; README "Speculative decoding" has its figures)
    .venv/bin/python tools/train_nano.py --dspark --dspark-steps 2400 --dspark-out dwarfstar/data/nano-dspark.gguf

Every mechanism of V4 is in the network and is trained:
- raw-window layers, ratio-4 layers with the lightning indexer and ratio-128 layers (small window,
  sequences of a few hundred tokens, so both compressors emit rows and the indexer picks a subset);
- hash-routed MoE layers (a frequency-balanced token table), learned-routed ones with the router bias
  moved by DeepSeek's auxiliary-loss-free balancing, a shared expert in every layer; mHC; sinks.

The indexer only selects rows, so the language-model loss gives it no gradient. It is fitted as in
DeepSeek V3.2: a KL loss pulls its score distribution toward the main attention's mass over the
compressed rows (summed over heads), first with every visible row attended (dense warm-up), then
only over the rows it selected. Its weight is small: Adam normalises each parameter's step, so the
indexer-only weights still learn at the full rate while the weights it shares with attention (the
query LoRA and the layer input) barely feel it, close to V3.2's detached indexer input.

Samples are book text after BOS, one-turn book chats, thinking turns and tool-call round trips
(dwarfstar/train/chat_data.py), rendered as the server renders them; in the chat forms only what
the assistant writes is a target (a book chat's user words too, as they are the book).

A tool round trip is ~530 tokens, ~420 of them the system prompt declaring the tools, one of six
(three client shapes, two templates), and its call is decided by a few tokens (the tool name and the
argument copied from the request). So each step draws `tool_batch` round trips sharing one of those
prefixes, runs the prefix once without autograd and continues each sample from a fork of its state
(the state keeps detached rows, as at inference), and weighs the call's targets by `call_weight`.
Held-out tool requests are scored in process (dwarfstar/train/tool_eval.py) at each evaluation,
and teacher-forced (is each argument token the argmax, given the right ones before it).

The call's argument is the part to copy, 28 to 35 tokens after it occurs in the request: it is
weighed by `arg_weight` (with the token that closes it), and two cheap sample kinds teach the copy
alone: `call_batch` calls (request and call, no result) whose arguments are invented from random
word pieces, so no memorised word predicts them, and `copy_batch` synthetic runs repeated once
(chat_data.copy_sample), the induction the copy is made of.

The softmax is restricted to the ids of the training data plus one learned row standing for all
others (dwarfstar/train/params.py), which the file's full 129,280-id head reproduces exactly. The
QAT rounding (FP8 KV, FP4 indexer) is not differentiable: training runs without it, and held-out
perplexity is reported with it on and off. Same seed, same thread count: same file.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dwarfstar.gguf.constants import GGMLType
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.loader import open_model
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train.chat_data import thinking_samples, tool_samples
from dwarfstar.train.copy_tokens import TwinSet
from dwarfstar.train.corpus import chat_prompts, read_split
from dwarfstar.train.dspark import DSparkRecipe, DSparkTrainer, train_dspark
from dwarfstar.train.mtp import MTPRecipe, train_mtp
from dwarfstar.train.trainer import NANO, TWIN_K, Recipe, Trainer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
MTP_CHATS = 64  # tool round trips and thinking turns, each, beside the MTP block's 384 book windows


def draft_corpus(opts: argparse.Namespace) -> tuple[np.ndarray, int, list[np.ndarray]]:
    """What a draft of the bundled model trains on besides the book's ids: chats the trunk was trained
    on (tool round trips, some in thinking mode, and thinking turns), a quarter of the sequences as
    in the trunk's steps. Returns (the book's ids, BOS, the chats)."""
    tokenizer = Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), NANO.vocab_size)
    book = read_split(opts.corpus).train
    ids = np.asarray(tokenizer.encode(book), dtype=np.int64)
    rng = np.random.default_rng(opts.seed)
    prompts = chat_prompts(book, 2 * MTP_CHATS, opts.seed + 1)
    thinking = thinking_samples(book, tokenizer, prompts, Recipe.seq_len + 1, rng)
    tools = tool_samples(book, tokenizer, MTP_CHATS, opts.seed, Recipe.tool_thinking)
    return ids, tokenizer.bos_id, [s.ids for s in tools + thinking[:MTP_CHATS]]


def train_nano_mtp(opts: argparse.Namespace) -> None:
    """The MTP block of the bundled model (dwarfstar/train/mtp.py), the trunk frozen."""
    torch.manual_seed(opts.seed)
    torch.set_num_threads(opts.threads)
    began = time.perf_counter()
    ids, bos, chats = draft_corpus(opts)
    recipe = MTPRecipe(steps=opts.mtp_steps)
    trainer = train_mtp(open_model(opts.out), ids, bos, recipe, opts.seed, print, chats)
    trainer.export(opts.mtp_out)
    print(f"wrote {opts.mtp_out} ({opts.mtp_out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - began:.0f} s")


def train_nano_dspark(opts: argparse.Namespace) -> None:
    """A DSpark drafter for the bundled model (dwarfstar/train/dspark.py), the model frozen: 3 stages
    over its last three layers, blocks of 5."""
    torch.manual_seed(opts.seed)
    torch.set_num_threads(opts.threads)
    began = time.perf_counter()
    ids, bos, chats = draft_corpus(opts)
    model = open_model(opts.out)
    layers = model.args.n_layers
    d = DSparkArgs(markov_rank=32, target_layers=(layers - 3, layers - 2, layers - 1))
    recipe = DSparkRecipe(steps=opts.dspark_steps, lr=opts.dspark_lr)

    def save(trainer: DSparkTrainer) -> None:
        trainer.export(opts.dspark_out, GGMLType.Q8_0)
        if opts.dspark_f32_out:
            trainer.export(opts.dspark_f32_out)

    save(train_dspark(model, d, ids, bos, recipe, opts.seed, print, chats, save, init=opts.dspark_init))
    size = opts.dspark_out.stat().st_size / 1e6
    print(f"wrote {opts.dspark_out} ({size:.1f} MB, Q8_0 matrices) in {time.perf_counter() - began:.0f} s")


def log_tool_accuracy(trainer: Trainer, n: int, log: Callable[[str], None]) -> None:
    """The held-out evaluations at a step: teacher-forced arguments, agent prompts, calls, greetings."""
    for form, calls in (("quoted", trainer.heldout_calls), ("bare", trainer.heldout_bare)):
        whole, first, later = trainer.argument_accuracy(calls)
        log(
            f"step {trainer.step}: held-out call arguments, {form}, teacher-forced: {whole:.0%} whole, "
            f"{first:.0%} first token, {later:.0%} of the later tokens"
        )
    if trainer.agent_eval_prompts:
        start = time.perf_counter()
        lines = trainer.agent_accuracy()
        log(f"step {trainer.step}: held-out agent prompts ({time.perf_counter() - start:.0f} s): " + "; ".join(lines))
    if not n:
        return
    start = time.perf_counter()
    scores = trainer.tool_accuracy(n)
    log(
        f"step {trainer.step}: held-out tool calls "
        + ", ".join(f"{shape} {score.right}/{score.total} ({score.named} right tool)" for shape, score in scores)
        + f" ({time.perf_counter() - start:.0f} s); "
        + "; ".join(scores[0][1].samples)
    )
    start = time.perf_counter()
    greetings = trainer.greeting_accuracy()
    log(
        f"step {trainer.step}: held-out greetings ended, thinking "
        + ", ".join(f"{shape} {g.ended}/{g.total} ({g.called} opened a call)" for shape, g in greetings)
        + f" ({time.perf_counter() - start:.0f} s); "
        + "; ".join(greetings[0][1].samples)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, help="default dwarfstar/data/nano.gguf, build/twin-k/nano-twin.gguf for the twin"
    )
    parser.add_argument("--f32-out", type=Path, help="also write an all-F32 file (the source for quantization)")
    parser.add_argument("--workdir", type=Path, help="log and checkpoint (default build/nano, build/twin-k)")
    parser.add_argument("--init", type=Path, help="warm start: continue from this trained nano file's weights")
    parser.add_argument("--twin-k", action="store_true", help="train the 256-wide twin (quantizable to K blocks)")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--batch", type=int, default=Recipe.batch)
    parser.add_argument("--seq-len", type=int, default=Recipe.seq_len)
    parser.add_argument("--lr", type=float, default=Recipe.lr)
    parser.add_argument("--tool-batch", type=int, default=Recipe.tool_batch, help="tool round trips per step")
    parser.add_argument("--call-weight", type=float, default=Recipe.call_weight, help="loss weight of tool calls")
    parser.add_argument("--arg-weight", type=float, default=Recipe.arg_weight, help="loss weight of call arguments")
    parser.add_argument(
        "--first-weight", type=float, default=Recipe.first_weight, help="loss weight of an argument's first token"
    )
    parser.add_argument(
        "--answer-weight", type=float, default=Recipe.answer_weight, help="loss weight of a round trip's answer"
    )
    parser.add_argument(
        "--decision-weight",
        type=float,
        default=Recipe.decision_weight,
        help="loss weight of a turn's first reply token",
    )
    parser.add_argument(
        "--name-weight", type=float, help="loss weight of a call's tool name's first token (default: --call-weight)"
    )
    parser.add_argument(
        "--tool-thinking", type=float, default=Recipe.tool_thinking, help="share of tool round trips in thinking mode"
    )
    parser.add_argument(
        "--tool-reasoning", action="store_true", help="their and the agent turns' reasoning: one sentence, not empty"
    )
    parser.add_argument(
        "--tool-greetings", type=float, default=Recipe.tool_greetings, help="tools-prompt samples that are greetings"
    )
    parser.add_argument(
        "--tool-client", type=float, default=Recipe.tool_client, help="tools prompts with the clients' own tools"
    )
    parser.add_argument(
        "--tool-bare", type=float, default=Recipe.tool_bare, help="tools-prompt requests with the argument bare"
    )
    parser.add_argument("--composed-greetings", action="store_true", help="500 composed greetings, not the 17")
    parser.add_argument("--call-batch", type=int, default=Recipe.call_batch, help="calls with invented arguments")
    parser.add_argument("--copy-batch", type=int, default=Recipe.copy_batch, help="synthetic copy sequences")
    parser.add_argument("--copy-vocab", type=int, default=Recipe.copy_vocab)
    parser.add_argument("--copy-lengths", type=int, nargs=2, default=Recipe.copy_lengths)
    parser.add_argument(
        "--no-copy-init", action="store_true", help="start from plain random weights, no planted copy circuit"
    )
    parser.add_argument(
        "--no-find-init", action="store_true", help="plant the copy circuit without its copy-start head"
    )
    parser.add_argument(
        "--no-bare-find-init",
        action="store_true",
        help="with --tool-bare, plant no head for a bare argument's start (and no twin codes)",
    )
    parser.add_argument(
        "--twins",
        type=TwinSet,
        choices=list(TwinSet),
        default=Recipe.twins,
        help="with --tool-bare, the twin pairs whose codes are tied: all; free of the templates', declarations', "
        "markup's and greetings' pieces; of those, the training arguments' first pieces",
    )
    parser.add_argument("--tool-evals", type=int, default=20, help="held-out tool requests per shape at each eval")
    parser.add_argument("--agent-batch", type=int, default=Recipe.agent_batch, help="agent-prompt turns per step")
    parser.add_argument("--agent-prompts", type=int, default=Recipe.agent_prompts, help="generated agent prompts")
    parser.add_argument("--agent-tokens", type=int, nargs=2, default=Recipe.agent_tokens, help="their length bounds")
    parser.add_argument("--agent-pool", type=int, default=Recipe.agent_pool, help="turns drawn per agent prompt")
    parser.add_argument(
        "--agent-greetings", type=float, default=Recipe.agent_greetings, help="share of agent turns that are greetings"
    )
    parser.add_argument("--agent-refresh", type=int, default=Recipe.agent_refresh, help="steps a prompt state is kept")
    parser.add_argument(
        "--agent-autograd", action="store_true", help="run each agent turn's whole prompt with autograd"
    )
    parser.add_argument("--tool-autograd", action="store_true", help="the same for the short tools prompts")
    parser.add_argument("--agent-noise", type=float, default=Recipe.agent_noise, help="agent prompt ids replaced")
    parser.add_argument("--agent-evals", type=int, default=0, help="held-out agent prompts at each eval")
    # one thread: on the shared 2-core machine a second OpenMP thread mostly waits for the first
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--resume", action="store_true", help="continue from the workdir checkpoint")
    parser.add_argument("--mtp", action="store_true", help="train an MTP block on the frozen --out model instead")
    parser.add_argument("--mtp-out", type=Path, default=ROOT / "dwarfstar" / "data" / "nano-mtp.gguf")
    parser.add_argument("--mtp-steps", type=int, default=MTPRecipe.steps)
    parser.add_argument("--dspark", action="store_true", help="train a DSpark drafter on the frozen --out model")
    parser.add_argument("--dspark-out", type=Path, default=ROOT / "build" / "nano" / "nano-dspark.gguf")  # Q8_0
    parser.add_argument("--dspark-f32-out", type=Path, help="also write the drafter in F32 here")
    parser.add_argument("--dspark-steps", type=int, default=DSparkRecipe.steps)
    parser.add_argument("--dspark-lr", type=float, default=DSparkRecipe.lr)
    parser.add_argument("--dspark-init", type=Path, help="continue training this drafter (its F32 file)")
    opts = parser.parse_args()
    build = ROOT / "build" / ("twin-k" if opts.twin_k else "nano")
    opts.workdir = opts.workdir or build
    opts.out = opts.out or (build / "nano-twin.gguf" if opts.twin_k else ROOT / "dwarfstar" / "data" / "nano.gguf")
    if opts.twin_k and opts.init:
        parser.error("--init continues the bundled nano model; the twin is trained from scratch")
    if opts.mtp:
        train_nano_mtp(opts)
        return
    if opts.dspark:
        train_nano_dspark(opts)
        return

    opts.workdir.mkdir(parents=True, exist_ok=True)
    log_file = (opts.workdir / "train.log").open("a", encoding="utf-8")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    torch.manual_seed(opts.seed)
    recipe = Recipe(
        steps=opts.steps,
        batch=opts.batch,
        seq_len=opts.seq_len,
        lr=opts.lr,
        tool_batch=opts.tool_batch,
        tool_thinking=opts.tool_thinking,
        tool_reasoning=opts.tool_reasoning,
        tool_greetings=opts.tool_greetings,
        tool_client=opts.tool_client,
        tool_bare=opts.tool_bare,
        composed_greetings=opts.composed_greetings,
        call_weight=opts.call_weight,
        arg_weight=opts.arg_weight,
        first_weight=opts.first_weight,
        answer_weight=opts.answer_weight,
        decision_weight=opts.decision_weight,
        name_weight=opts.name_weight,
        call_batch=opts.call_batch,
        copy_batch=opts.copy_batch,
        copy_vocab=opts.copy_vocab,
        copy_lengths=tuple(opts.copy_lengths),
        copy_init=not opts.no_copy_init,
        find_init=not opts.no_find_init,
        bare_find_init=not opts.no_bare_find_init,
        twins=opts.twins,
        agent_batch=opts.agent_batch,
        agent_prompts=opts.agent_prompts,
        agent_tokens=tuple(opts.agent_tokens),
        agent_pool=opts.agent_pool,
        agent_greetings=opts.agent_greetings,
        agent_refresh=opts.agent_refresh,
        agent_autograd=opts.agent_autograd,
        tool_autograd=opts.tool_autograd,
        agent_noise=opts.agent_noise,
    )
    began = time.perf_counter()
    shape = TWIN_K if opts.twin_k else NANO
    trainer = Trainer(recipe, opts.seed, opts.corpus, log, shape=shape, init=opts.init, agent_evals=opts.agent_evals)
    log(f"recipe: {json.dumps(recipe.__dict__)}; args: {shape}; warm start: {opts.init}")
    checkpoint = opts.workdir / "checkpoint.pt"
    if opts.resume and checkpoint.exists():
        trainer.load(checkpoint)
        log(f"resumed at step {trainer.step}")
    dense_steps = int(recipe.dense_warmup * recipe.steps)
    model = None
    tokens, window_start = 0, time.perf_counter()
    while trainer.step < recipe.steps:
        dense = trainer.step < dense_steps
        if model is None or trainer.step == dense_steps:
            model = trainer.model(dense_indexer=dense)
        torch.set_num_threads(opts.threads)  # building a reference model (evaluation too) picks one thread
        lm, kl, imbalance, step_tokens = trainer.train_step(model)
        tokens += step_tokens
        if trainer.step % opts.log_every == 0:
            elapsed = time.perf_counter() - window_start
            log(
                f"step {trainer.step}/{recipe.steps} loss {lm:.3f} indexer-kl {kl:.3f} load max/mean "
                f"{imbalance:.2f} lr {trainer.lr_at(trainer.step):.2e} {tokens / elapsed:.0f} tok/s "
                f"{'dense' if dense else 'sparse'} t {time.perf_counter() - began:.0f} s"
            )
            tokens, window_start = 0, time.perf_counter()
        if trainer.step % opts.eval_every == 0 or trainer.step == recipe.steps:
            trainer.save(checkpoint)
            log(f"step {trainer.step}: held-out loss {trainer.heldout_loss(qat=False, limit=4096):.3f} (4096 tokens)")
            log_tool_accuracy(trainer, opts.tool_evals, log)
    results = {qat: trainer.heldout_loss(qat=qat) for qat in (False, True)}
    for qat, loss in results.items():
        log(
            f"held-out ({len(trainer.heldout_ids)} tokens), QAT rounding {'on' if qat else 'off'}: "
            f"loss {loss:.4f}, perplexity {math.exp(loss):.2f}"
        )
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    trainer.export(opts.out, "q8_0")
    log(f"wrote {opts.out} ({opts.out.stat().st_size / 1e6:.1f} MB)")
    if opts.f32_out:
        trainer.export(opts.f32_out, "f32")
        log(f"wrote {opts.f32_out} ({opts.f32_out.stat().st_size / 1e6:.1f} MB)")
    log(f"total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
