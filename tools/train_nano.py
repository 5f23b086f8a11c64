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
    .venv/bin/python tools/train_nano.py --twin-k   # the 256-wide twin, written under build/
    .venv/bin/python tools/train_nano.py --mtp [--mtp-steps N] [--mtp-out dwarfstar/data/nano-mtp.gguf]

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
import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.gguf.reader import open_gguf
from dwarfstar.model.config import ModelArgs, flash_compress_ratios
from dwarfstar.model.loader import open_model
from dwarfstar.model.tensors import INDEX, expected_tensors
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train.chat_data import (
    TOOLS,
    Sample,
    call_markers,
    call_only,
    copy_sample,
    quote_openers,
    thinking_samples,
    tool_requests,
    tool_samples,
    word_pieces,
)
from dwarfstar.train.corpus import chat_prompts, chat_samples, read_split
from dwarfstar.train.induction import plant_copy_circuit
from dwarfstar.train.mtp import MTPRecipe, train_mtp
from dwarfstar.train.observers import IndexerLoss, RouterBalance
from dwarfstar.train.params import (
    REST,
    ParamWeights,
    balanced_hash_table,
    compact,
    expand,
    init_params,
    rest_log_count,
    write_gguf,
)
from dwarfstar.train.tool_eval import ToolCallScore, tool_call_accuracy

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
MTP_CHATS = 64  # tool round trips and thinking turns, each, beside the MTP block's 384 book windows

NANO = ModelArgs(
    n_layers=6,
    dim=96,
    n_heads=4,
    head_dim=64,
    rope_dim=16,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    n_routed_experts=8,
    n_activated_experts=2,
    moe_inter_dim=128,
    n_hash_layers=2,
    # 64: a tool call copies its argument from the request across the ~28 tokens of DSML that open
    # the call (`<｜Assistant｜></think>` to `string="true">`), which a window of 32 barely reaches
    window=64,
    compress_ratios=flash_compress_ratios(6),
    index_n_heads=4,
    index_head_dim=32,
    index_topk=16,
    max_seq_len=65536,
)
# the quantizable twin: hidden and expert widths of 256, the block size of Q4_K, Q2_K and IQ2_XXS
TWIN_K = NANO.with_(dim=256, moe_inter_dim=256)
DENSE_TOPK = 1 << 20  # index_topk of the warm-up model: every visible compressed row is attended


@dataclass(frozen=True)
class Recipe:
    steps: int = 800
    batch: int = 6
    seq_len: int = 384
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.05  # fraction of the steps with a linear learning-rate ramp
    weight_decay: float = 0.05
    clip: float = 1.0
    chat_fraction: float = 0.1  # share of samples in the one-turn chat form
    thinking_fraction: float = 0.2  # thinking-mode book chats; the rest of `batch` is book text after BOS
    # tool round trips per step besides `batch`, all with one of the tools prefixes (client shape and
    # template), which the step then runs once: a round trip's own part is ~110 tokens
    tool_batch: int = 3
    chat_pool: int = 4000
    tool_pool: int = 3000
    tool_thinking: float = 0.3  # share of tool round trips in thinking mode (empty reasoning)
    call_weight: float = 2.0  # loss weight of a tool call's targets
    arg_weight: float = 3.0  # loss weight of the argument a call copies and of the token closing it
    # loss weight of the argument's first token, the one the copy must find after the request's opening
    # quote or backtick (later tokens follow their predecessor's copy in the request)
    first_weight: float = 3.0
    answer_weight: float = 3.0  # loss weight of a round trip's final answer (it quotes the tool result)
    # tool calls alone (request, call, EOS) per step besides `tool_batch`, with invented arguments
    # (random word pieces) that only copying predicts, from a pool of `call_pool`, same prefix
    call_batch: int = 5
    call_pool: int = 6000
    copy_batch: int = 4  # synthetic copy sequences per step (chat_data.copy_sample)
    copy_lengths: tuple[int, int] = (8, 40)  # their run lengths: the repeat is that far back
    copy_vocab: int = 0  # the copy runs draw from this many pieces (0: all)
    copy_init: bool = True  # a from-scratch run starts with the copy circuit planted (dwarfstar/train/induction.py)
    # and with its head that finds a copy's start: at a call's `">` the token after the request's quote
    find_init: bool = True
    indexer_kl: float = 0.01
    dense_warmup: float = 0.1  # fraction of the steps with the indexer selecting every row
    bias_gamma: float = 0.01  # router bias step of the balancing update
    eval_len: int = 512


def warm_params(path: Path, shape: ModelArgs, vocab: torch.Tensor) -> dict[str, torch.Tensor]:
    """A trained file's tensors (dequantized) as full-vocabulary parameters, to continue training.

    Its `output.rest` row is the output row of an id outside `vocab`: the file wrote that row into
    every id outside its own vocabulary, which `vocab` contains.
    """
    with open_gguf(path) as gguf:
        params = {spec.name: gguf.tensor(spec.name).float().clone() for spec in expected_tensors(shape)}
        for spec in expected_tensors(shape):
            if tuple(params[spec.name].shape) != tuple(spec.shape):
                raise SystemExit(f"{path}: {spec.name} is {tuple(params[spec.name].shape)}, expected {spec.shape}")
            if spec.types == INDEX:
                params[spec.name] = params[spec.name].to(torch.int32)
    outside = torch.ones(shape.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    rows = params["output.weight"][outside.nonzero()[[0, -1], 0]]
    if not torch.equal(rows[0], rows[1]):
        raise SystemExit(f"{path}: ids outside the corpus have different output rows; not a nano file")
    params[REST] = rows[0].clone()
    return params


class Trainer:
    def __init__(
        self,
        recipe: Recipe,
        seed: int,
        corpus: Path,
        log: Callable[[str], None],
        shape: ModelArgs = NANO,
        init: Path | None = None,
    ) -> None:
        self.recipe, self.seed, self.log, self.shape = recipe, seed, log, shape
        start = time.perf_counter()
        tokenizer = Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), shape.vocab_size)
        split = read_split(corpus)
        self.train_ids = np.asarray(tokenizer.encode(split.train), dtype=np.int64)
        self.heldout_ids = np.asarray(tokenizer.encode(split.heldout), dtype=np.int64)
        self.bos, self.eos = tokenizer.bos_id, tokenizer.eos_id
        self.tokenizer, self.book = tokenizer, split.train
        self.assistant = tokenizer.token_id("<｜Assistant｜>")
        length = recipe.seq_len + 1
        self.chats = [
            Sample(ids, ids[1:] != self.assistant)
            for ids in chat_samples(split.train, tokenizer, recipe.chat_pool, length, seed)
        ]
        prompts = chat_prompts(split.train, recipe.chat_pool, seed + 1)
        self.thinking = thinking_samples(split.train, tokenizer, prompts, length, np.random.default_rng(seed))
        self.tools = tool_samples(split.train, tokenizer, recipe.tool_pool, seed, recipe.tool_thinking)
        groups: dict[bytes, list[Sample]] = {}
        for sample in self.tools:
            groups.setdefault(sample.ids[: sample.prefix].tobytes(), []).append(sample)
        self.tool_groups = list(groups.values())
        pieces = word_pieces(split.train, tokenizer)
        self.piece_ids = np.asarray([tokenizer.token_id(p) for p in pieces], dtype=np.int64)
        if recipe.copy_vocab:
            self.copy_ids = np.random.default_rng(seed).choice(self.piece_ids, recipe.copy_vocab, replace=False)
        else:
            self.copy_ids = self.piece_ids
        calls = [
            call_only(s, self.eos)
            for s in tool_samples(split.train, tokenizer, recipe.call_pool, seed + 2, 0.0, pieces=pieces)
        ]
        self.call_groups = {key: [] for key in groups}
        for sample in calls:
            self.call_groups[sample.ids[: sample.prefix].tobytes()].append(sample)
        # scored teacher-forced at each evaluation: do the held-out calls' arguments come out right
        self.heldout_calls = [
            call_only(s, self.eos) for s in tool_samples(split.train, tokenizer, 60, seed + 100, 0.0, heldout=True)
        ]
        # held-out tool requests are inputs at test time: they get embeddings (trained as negatives only)
        heldout_requests = tool_requests(split.train, recipe.tool_pool, seed, heldout=True)
        heldout_request_ids = tokenizer.encode("\n".join(r.text for r in heldout_requests))
        # the softmax covers the ids that occur in the book (held-out tail included, so evaluation has
        # an embedding for every input; ids met only there are trained as negatives, never as targets)
        seen = np.concatenate(
            [
                self.train_ids,
                *(s.ids for s in self.chats + self.thinking + self.tools + calls),
                self.piece_ids,
                [self.bos],
            ]
        )
        unseen = np.concatenate((self.heldout_ids, heldout_request_ids, *(s.ids for s in self.heldout_calls)))
        self.vocab = torch.as_tensor(np.unique(np.concatenate((seen, unseen))))  # compact i = vocab[i]
        self.local = torch.full((shape.vocab_size,), -1, dtype=torch.long)
        self.local[self.vocab] = torch.arange(self.vocab.numel())
        counts = torch.bincount(self.local[torch.as_tensor(seen)], minlength=self.vocab.numel())
        self.args = shape.with_(vocab_size=self.vocab.numel())
        if init is None:
            self.full = init_params(shape, seed)
            if recipe.copy_init:
                markers, openers = (call_markers(tokenizer), quote_openers(tokenizer)) if recipe.find_init else ((), ())
                plant_copy_circuit(self.full, shape, seed, markers=markers, openers=openers)
        else:
            self.full = warm_params(init, shape, self.vocab)
        params = compact(self.full, self.vocab)
        if init is None:
            for il in range(shape.n_hash_layers):
                params[f"blk.{il}.ffn_gate_tid2eid.weight"] = balanced_hash_table(
                    counts, shape.n_routed_experts, shape.n_activated_experts, seed + il
                )
        # selection-only tensors get no gradient: the hash tables are fixed, the router biases move by
        # the balancing rule, the rest learns by gradient
        self.params = {
            name: t if t.dtype != torch.float32 or name.endswith("exp_probs_b.bias") else t.requires_grad_()
            for name, t in params.items()
        }
        self.rest_offset = rest_log_count(shape.vocab_size, self.vocab.numel())
        self.indexer_loss = IndexerLoss()
        self.balance = RouterBalance(self.params, self.args, recipe.bias_gamma)
        trainable = [t for t in self.params.values() if t.requires_grad]
        decay = [t for t in trainable if t.dim() >= 2]
        no_decay = [t for t in trainable if t.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=recipe.lr,
            betas=(0.9, 0.95),
        )
        self.rng = np.random.default_rng(seed)
        self.step = 0
        n_params = sum(t.numel() for t in trainable)
        self.log(
            f"data: {len(self.train_ids)} training tokens, {len(self.heldout_ids)} held out, "
            f"{len(self.chats)} chat, {len(self.thinking)} thinking and {len(self.tools)} tool samples "
            f"(tool samples {np.mean([len(s.ids) for s in self.tools]):.0f} tokens on average, "
            f"{np.mean([s.prefix for s in self.tools]):.0f} of them in {len(self.tool_groups)} shared prefixes), "
            f"{self.vocab.numel()} distinct ids; "
            f"{n_params / 1e6:.2f} M trainable parameters; prepared in {time.perf_counter() - start:.1f} s"
        )

    # -- model ------------------------------------------------------------------------------------
    def model(self, qat: bool = False, dense_indexer: bool = False) -> ReferenceModel:
        args = self.args.with_(index_topk=DENSE_TOPK) if dense_indexer else self.args
        model = ReferenceModel.from_weights(args, ParamWeights(self.params), qat=qat)
        model.ops.indexer_observer, model.ops.route_observer = self.indexer_loss, self.balance
        return model

    def head(self, y: torch.Tensor) -> torch.Tensor:
        """Logits over the corpus ids, then one for all other ids together."""
        rest = y @ self.params[REST] + self.rest_offset
        return torch.cat((y @ self.params["output.weight"].T, rest[:, None]), dim=1)

    # -- data -------------------------------------------------------------------------------------
    def batch(self) -> list[Sample]:
        r, n = self.recipe, self.recipe.seq_len
        group = self.tool_groups[int(self.rng.integers(len(self.tool_groups)))]
        out = [group[int(i)] for i in self.rng.integers(len(group), size=r.tool_batch)]
        if r.call_batch:
            calls = self.call_groups[group[0].ids[: group[0].prefix].tobytes()]
            out += [calls[int(i)] for i in self.rng.integers(len(calls), size=r.call_batch)]
        out += [copy_sample(self.copy_ids, self.bos, self.rng, r.copy_lengths) for _ in range(r.copy_batch)]
        for _ in range(r.batch):
            draw = self.rng.random()
            for pool, share in ((self.chats, r.chat_fraction), (self.thinking, r.thinking_fraction)):
                if draw < share:
                    out.append(pool[int(self.rng.integers(len(pool)))])
                    break
                draw -= share
            else:
                start = int(self.rng.integers(len(self.train_ids) - n))
                ids = np.concatenate(([self.bos], self.train_ids[start : start + n]))
                out.append(Sample(ids, np.ones(n, dtype=bool)))
        return out

    def targets(self, sample: Sample) -> torch.Tensor:
        """Next-token targets in compact ids, -100 where the sample does not train them."""
        nxt = self.local[torch.as_tensor(sample.ids[1:])]
        return nxt.masked_fill(~torch.as_tensor(sample.trained), -100)

    # -- training ---------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        r = self.recipe
        warm = max(1, int(r.warmup * r.steps))
        if step < warm:
            return r.lr * (step + 1) / warm
        t = (step - warm) / max(1, r.steps - warm)
        return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    def weights(self, sample: Sample) -> torch.Tensor:
        """Per target: `call_weight` on a tool round trip's first assistant turn (the call, whose few
        name and argument tokens decide it; its fixed DSML is soon learned), `arg_weight` on the
        argument and the token that closes it (the copy, the part the call gets wrong), `first_weight`
        on its first token, `answer_weight` on what follows the call (the answer quoting the tool's
        result), 1 elsewhere."""
        weights = torch.ones(len(sample.ids) - 1)
        if sample.prefix:
            weights[: int(np.flatnonzero(sample.ids == self.eos)[0])] = self.recipe.call_weight
            start, end = sample.argument
            weights[start - 1 : end] = self.recipe.arg_weight  # target i predicts ids[i + 1]
            weights[start - 1] = self.recipe.first_weight
            weights[int(np.flatnonzero(sample.ids == self.eos)[0]) :] = self.recipe.answer_weight
        return weights[sample.prefix :]

    def hidden(self, model: ReferenceModel, samples: list[Sample]) -> torch.Tensor:
        """Final rows of every sample's trained span; the shared prefixes (tool declarations) run
        once, without autograd and unobserved, and each of their samples continues from a fork."""
        prefixes: dict[bytes, object] = {}
        for s in samples:
            if s.prefix:
                prefixes.setdefault(s.ids[: s.prefix].tobytes(), s.ids[: s.prefix])
        states = {key: model.new_state() for key in prefixes}
        if prefixes:
            observers = model.ops.indexer_observer, model.ops.route_observer
            model.ops.indexer_observer = model.ops.route_observer = None
            with torch.no_grad():
                model.hidden_batch(
                    [self.local[torch.as_tensor(ids)] for ids in prefixes.values()], list(states.values()), False
                )
            model.ops.indexer_observer, model.ops.route_observer = observers
        inputs = [self.local[torch.as_tensor(s.ids[s.prefix : -1])] for s in samples]
        forks = [copy.deepcopy(states[s.ids[: s.prefix].tobytes()]) if s.prefix else model.new_state() for s in samples]
        return torch.cat(model.hidden_batch(inputs, forks))

    def train_step(self, model: ReferenceModel) -> tuple[float, float, float, int]:
        """One optimizer step: (weighted loss, indexer KL, worst load ratio, tokens run with autograd)."""
        samples = self.batch()
        y = self.hidden(model, samples)
        targets = torch.cat([self.targets(s)[s.prefix :] for s in samples])
        losses = F.cross_entropy(self.head(y), targets, reduction="none")
        lm = (losses * torch.cat([self.weights(s) for s in samples])).sum() / (targets != -100).sum()
        kl = self.indexer_loss.pop()
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.opt.zero_grad(set_to_none=True)
        (lm + self.recipe.indexer_kl * kl).backward()
        torch.nn.utils.clip_grad_norm_([t for t in self.params.values() if t.requires_grad], self.recipe.clip)
        self.opt.step()
        imbalance = self.balance.update()
        self.step += 1
        return float(lm.detach()), float(kl.detach()), imbalance, y.shape[0]

    def tool_accuracy(self, n: int) -> list[tuple[str, ToolCallScore]]:
        """Held-out tool requests (other seeds than the served checks' 0-2) per client shape."""
        model = self.model()
        model.ops.indexer_observer = model.ops.route_observer = None
        return [
            (shape, tool_call_accuracy(model, self.head, self.local, self.vocab, self.tokenizer, requests, shape))
            for i, shape in enumerate(sorted(TOOLS))
            for requests in [tool_requests(self.book, n, 100 + i, heldout=True)]
        ]

    @torch.no_grad()
    def argument_accuracy(self) -> tuple[float, float, float]:
        """Teacher-forced on held-out calls: the share whose argument tokens and closing token are
        all the argmax, the share with the first one right (found in the request; a directory is
        one of ten, so it can be guessed) and the share of later argument tokens right (each
        follows its predecessor's copy in the request; an extension is one of four)."""
        model = self.model()
        model.ops.indexer_observer = model.ops.route_observer = None
        predicted = self.head(self.hidden(model, self.heldout_calls)).argmax(-1)
        whole = first = later = n_later = offset = 0
        for s in self.heldout_calls:
            start, end = s.argument
            span = slice(offset + start - 1 - s.prefix, offset + end - s.prefix)
            hit = predicted[span] == self.local[torch.as_tensor(s.ids[start : end + 1])]
            whole, first = whole + bool(hit.all()), first + bool(hit[0])
            later, n_later = later + int(hit[1:-1].sum()), n_later + len(hit) - 2
            offset += len(s.ids) - 1 - s.prefix
        n = len(self.heldout_calls)
        return whole / n, first / n, later / max(1, n_later)

    @torch.no_grad()
    def heldout_loss(self, qat: bool, limit: int | None = None) -> float:
        """Mean next-token loss on the held-out text, in chunks of eval_len tokens after BOS."""
        model = self.model(qat=qat)
        model.ops.indexer_observer = model.ops.route_observer = None
        ids = self.local[torch.as_tensor(self.heldout_ids[:limit])]
        total, count = 0.0, 0
        n = self.recipe.eval_len
        for start in range(0, ids.numel() - 1, n):
            chunk = torch.cat((self.local[self.bos].view(1), ids[start : start + n]))
            (y,) = model.hidden_batch([chunk[:-1]], [model.new_state()])
            total += float(F.cross_entropy(self.head(y), chunk[1:], reduction="sum"))
            count += chunk.numel() - 1
        return total / count

    # -- checkpoints and export -------------------------------------------------------------------
    def save(self, path: Path) -> None:
        torch.save(
            {
                "step": self.step,
                "params": self.params,
                "opt": self.opt.state_dict(),
                "rng": self.rng.bit_generator.state,
            },
            path,
        )

    def load(self, path: Path) -> None:
        saved = torch.load(path, weights_only=False)
        with torch.no_grad():
            for name, t in self.params.items():
                t.copy_(saved["params"][name])
        self.opt.load_state_dict(saved["opt"])
        self.rng.bit_generator.state = saved["rng"]
        self.step = saved["step"]

    def export(self, path: Path, layout: str) -> None:
        full = expand(self.full, self.params, self.vocab)
        name = "DwarfStar nano (I promessi sposi)" if self.shape == NANO else "DwarfStar nano 256-wide twin"
        write_gguf(path, self.shape, full, layout, name=name)


def log_tool_accuracy(trainer: Trainer, n: int, log: Callable[[str], None]) -> None:
    whole, first, later = trainer.argument_accuracy()
    log(
        f"step {trainer.step}: held-out call arguments, teacher-forced: {whole:.0%} whole, "
        f"{first:.0%} first token, {later:.0%} of the later tokens"
    )
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


def train_nano_mtp(opts: argparse.Namespace) -> None:
    """The MTP block of the bundled model (dwarfstar/train/mtp.py), the trunk frozen."""
    torch.manual_seed(opts.seed)
    torch.set_num_threads(opts.threads)
    began = time.perf_counter()
    tokenizer = Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), NANO.vocab_size)
    book = read_split(opts.corpus).train
    ids = np.asarray(tokenizer.encode(book), dtype=np.int64)
    # chats the trunk was trained on besides the book: tool round trips (thinking mode for some) and
    # thinking turns, a quarter of the sequences as in the trunk's steps
    rng = np.random.default_rng(opts.seed)
    prompts = chat_prompts(book, 2 * MTP_CHATS, opts.seed + 1)
    thinking = thinking_samples(book, tokenizer, prompts, Recipe.seq_len + 1, rng)
    tools = tool_samples(book, tokenizer, MTP_CHATS, opts.seed, Recipe.tool_thinking)
    chats = [s.ids for s in tools + thinking[:MTP_CHATS]]
    recipe = MTPRecipe(steps=opts.mtp_steps)
    trainer = train_mtp(open_model(opts.out), ids, tokenizer.bos_id, recipe, opts.seed, print, chats)
    trainer.export(opts.mtp_out)
    print(f"wrote {opts.mtp_out} ({opts.mtp_out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - began:.0f} s")


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
    parser.add_argument("--tool-evals", type=int, default=20, help="held-out tool requests per shape at each eval")
    # one thread: on the shared 2-core machine a second OpenMP thread mostly waits for the first
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--resume", action="store_true", help="continue from the workdir checkpoint")
    parser.add_argument("--mtp", action="store_true", help="train an MTP block on the frozen --out model instead")
    parser.add_argument("--mtp-out", type=Path, default=ROOT / "dwarfstar" / "data" / "nano-mtp.gguf")
    parser.add_argument("--mtp-steps", type=int, default=MTPRecipe.steps)
    opts = parser.parse_args()
    build = ROOT / "build" / ("twin-k" if opts.twin_k else "nano")
    opts.workdir = opts.workdir or build
    opts.out = opts.out or (build / "nano-twin.gguf" if opts.twin_k else ROOT / "dwarfstar" / "data" / "nano.gguf")
    if opts.twin_k and opts.init:
        parser.error("--init continues the bundled nano model; the twin is trained from scratch")
    if opts.mtp:
        train_nano_mtp(opts)
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
        call_weight=opts.call_weight,
        arg_weight=opts.arg_weight,
        first_weight=opts.first_weight,
        answer_weight=opts.answer_weight,
        call_batch=opts.call_batch,
        copy_batch=opts.copy_batch,
        copy_vocab=opts.copy_vocab,
        copy_lengths=tuple(opts.copy_lengths),
        copy_init=not opts.no_copy_init,
        find_init=not opts.no_find_init,
    )
    began = time.perf_counter()
    shape = TWIN_K if opts.twin_k else NANO
    trainer = Trainer(recipe, opts.seed, opts.corpus, log, shape=shape, init=opts.init)
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
