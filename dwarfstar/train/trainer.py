"""The nano model's trainer: the recipe, the trainable parameters over the corpus's ids, the batches,
the optimizer step and the evaluations. `tools/train_nano.py` runs it; its docstring describes the
data and the training.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.gguf.reader import open_gguf
from dwarfstar.model.config import ModelArgs, flash_compress_ratios
from dwarfstar.model.tensors import INDEX, expected_tensors
from dwarfstar.tokenizer.specials import THINK_END
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train.agent_data import GREETING_SHARE, agent_samples
from dwarfstar.train.agent_eval import agent_scores, generated_prompts, prompt_options, report
from dwarfstar.train.chat_data import (
    TOOLS,
    Sample,
    call_only,
    copy_sample,
    name_start,
    thinking_samples,
    tool_requests,
    tool_samples,
    word_pieces,
)
from dwarfstar.train.copy_tokens import TwinSet, bare_leads, call_markers, quote_openers, twin_set
from dwarfstar.train.corpus import chat_prompts, chat_samples, read_split
from dwarfstar.train.greetings import HELDOUT_GREETINGS
from dwarfstar.train.induction import plant_copy_circuit
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
from dwarfstar.train.prefix_states import PrefixStates, run_prefixes
from dwarfstar.train.tool_eval import GreetingScore, ToolCallScore, greeting_endings, tool_call_accuracy

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
ORDINARY_IDS = (3, 128000)  # the tokenizer's added tokens are 0-2 and 128000 on
NOISE_IDS = 4000  # ids standing for a client prompt's unknown ones (Recipe.agent_noise)
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
    tool_thinking: float = 0.3  # share of tool round trips in thinking mode
    # the thinking reasoning of these and of the agent turns: one sentence (chat_data.REASONING), else empty
    tool_reasoning: bool = False
    tool_greetings: float = 0.0  # share of the tools prompts' samples that are a greeting and its answer
    # share of the tools prompts (and of the calls') that declare and call the client's own core tools
    # (chat_data.CLIENT_TOOLS: `Read`/`file_path`, `exec_command`/`cat {}`...), as an agent prompt does
    tool_client: float = 0.0
    # share of the tools prompts' (and of the calls') requests whose argument is bare, not quoted or
    # backticked (chat_data.tool_requests), as the agent turns' are half the time
    tool_bare: float = 0.0
    # the greetings of the tools prompts and the agent turns: the seventeen fixed ones, or with this the
    # five hundred composed from their parts (greetings.COMPOSED_GREETINGS)
    composed_greetings: bool = False
    call_weight: float = 2.0  # loss weight of a tool call's targets
    arg_weight: float = 3.0  # loss weight of the argument a call copies and of the token closing it
    # loss weight of the argument's first token, the one the copy must find after the request's opening
    # quote or backtick (later tokens follow their predecessor's copy in the request)
    first_weight: float = 3.0
    answer_weight: float = 3.0  # loss weight of a round trip's final answer (it quotes the tool result)
    # loss weight of a turn's first reply token after a shared prefix: the one that decides, from the
    # request alone, between an answer and a call (and an agent turn's language)
    decision_weight: float = 1.0
    # loss weight of the first call's tool name's first token, the one that picks the tool (None:
    # `call_weight`, as the call's other tokens)
    name_weight: float | None = None
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
    # and, with bare requests (`tool_bare`), its head that finds a bare argument's start after the
    # template's last word and writes the twin without the space (` divor` -> `divor`)
    bare_find_init: bool = True
    # the twin pairs whose codes that planting ties (` divor`, `divor`): all, or fewer (copy_tokens.TwinSet)
    twins: TwinSet = TwinSet.ALL
    # turns after a coding agent's long system prompt (dwarfstar/train/agent_data.py) per step besides
    # the rest, all after one of `agent_prompts` generated prompts of `agent_tokens` tokens, whose
    # state is kept and run again every `agent_refresh` steps (dwarfstar/train/prefix_states.py)
    agent_batch: int = 0
    agent_prompts: int = 12
    agent_tokens: tuple[int, int] = (4000, 10000)
    agent_pool: int = 120  # turns drawn per prompt
    agent_greetings: float = GREETING_SHARE  # share of those turns that are greetings
    agent_refresh: int = 40
    # run each agent turn's whole prompt with autograd (and observed) instead of from a kept state: the
    # compressors, the indexer's keys and the prompt's rows then learn what the turns need from it
    # (which tools it declares), at the cost of the prompt's tokens in every sample
    agent_autograd: bool = False
    # the same for the short tools prompts (and the calls'): the declarations' rows then learn to be
    # found, so a call can name the tool a prompt declares rather than the name most often trained
    tool_autograd: bool = False
    # share of an agent prompt's ordinary tokens replaced by ids that occur in no training text: a real
    # client's prompt holds many ids whose embeddings training never moved, which these stand for
    agent_noise: float = 0.1
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


def shared_prefix(group: list[Sample]) -> list[Sample]:
    """A group's samples with their prefix extended over every token they share: the client's context
    before the user's words too (the environment block of a Messages or Responses request), so each
    step runs with autograd only the request and the reply."""
    first = group[0].ids
    n = min(len(s.ids) for s in group)
    differ = np.flatnonzero(np.any(np.stack([s.ids[:n] for s in group]) != first[:n], axis=0))
    end = int(differ[0]) if len(differ) else n
    return [replace(s, prefix=end) for s in group]


def noisy(group: list[Sample], noise_ids: np.ndarray, share: float, rng: np.random.Generator) -> list[Sample]:
    """A group's samples with `share` of their shared prefix's ordinary tokens replaced by `noise_ids`."""
    prefix = group[0].ids[: group[0].prefix].copy()
    at = (rng.random(len(prefix)) < share) & (prefix >= ORDINARY_IDS[0]) & (prefix < ORDINARY_IDS[1])
    prefix[at] = rng.choice(noise_ids, int(at.sum()))
    return [replace(s, ids=np.concatenate((prefix, s.ids[s.prefix :]))) for s in group]


class Trainer:
    def __init__(
        self,
        recipe: Recipe,
        seed: int,
        corpus: Path,
        log: Callable[[str], None],
        shape: ModelArgs = NANO,
        init: Path | None = None,
        agent_evals: int = 0,
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
        self.think_end = tokenizer.token_id(THINK_END)
        self.invoke = tokenizer.encode('invoke name="')  # what precedes a call's tool name
        length = recipe.seq_len + 1
        self.chats = [
            Sample(ids, ids[1:] != self.assistant)
            for ids in chat_samples(split.train, tokenizer, recipe.chat_pool, length, seed)
        ]
        prompts = chat_prompts(split.train, recipe.chat_pool, seed + 1)
        self.thinking = thinking_samples(split.train, tokenizer, prompts, length, np.random.default_rng(seed))
        self.tools = tool_samples(
            split.train,
            tokenizer,
            recipe.tool_pool,
            seed,
            recipe.tool_thinking,
            greetings=recipe.tool_greetings,
            reasoning=recipe.tool_reasoning,
            client_tools=recipe.tool_client,
            composed_greetings=recipe.composed_greetings,
            unquoted=recipe.tool_bare,
        )
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
            for s in tool_samples(
                split.train,
                tokenizer,
                recipe.call_pool,
                seed + 2,
                0.0,
                pieces=pieces,
                client_tools=recipe.tool_client,
                unquoted=recipe.tool_bare,
            )
        ]
        self.call_groups = {key: [] for key in groups}
        for sample in calls:
            self.call_groups[sample.ids[: sample.prefix].tobytes()].append(sample)
        # scored teacher-forced at each evaluation: do the held-out calls' arguments come out right
        # (and with the argument bare, the same requests)
        self.heldout_calls, self.heldout_bare = (
            [
                call_only(s, self.eos)
                for s in tool_samples(split.train, tokenizer, 60, seed + 100, 0.0, heldout=True, unquoted=unquoted)
            ]
            for unquoted in (0.0, 1.0)
        )
        # held-out tool requests and greetings are inputs at test time: they get embeddings (trained as
        # negatives only)
        heldout_requests = tool_requests(split.train, recipe.tool_pool, seed, heldout=True)
        heldout_texts = [r.text for r in heldout_requests] + [words for words, _, _ in HELDOUT_GREETINGS]
        heldout_request_ids = tokenizer.encode("\n".join(heldout_texts))
        self.agent_groups: list[list[Sample]] = []
        self.noise_ids = np.zeros(0, dtype=np.int64)
        self.agent_eval_prompts = []
        agent_heldout: list[Sample] = []
        if recipe.agent_batch:

            def count(text: str) -> int:
                return len(tokenizer.encode(text))

            rng = np.random.default_rng(seed + 7)
            trained = generated_prompts(recipe.agent_prompts, recipe.agent_tokens, count, first=seed * 1000)
            for i, prompt in enumerate(trained):
                samples = agent_samples(
                    prompt,
                    split.train,
                    tokenizer,
                    recipe.agent_pool,
                    seed + i,
                    prompt_options(i),
                    reasoning=recipe.tool_reasoning,
                    composed_greetings=recipe.composed_greetings,
                    greeting_share=recipe.agent_greetings,
                )
                self.agent_groups.append(shared_prefix(samples))
            known = np.unique(np.concatenate([s.ids for group in self.agent_groups for s in group]))
            self.noise_ids = np.setdiff1d(np.arange(ORDINARY_IDS[0], ORDINARY_IDS[1]), known)
            self.noise_ids = rng.choice(self.noise_ids, NOISE_IDS, replace=False)
            self.agent_groups = [noisy(g, self.noise_ids, recipe.agent_noise, rng) for g in self.agent_groups]
            self.agent_eval_prompts = generated_prompts(agent_evals, recipe.agent_tokens, count)
            agent_heldout = [
                s
                for i, p in enumerate(self.agent_eval_prompts)
                for s in agent_samples(p, split.train, tokenizer, 8, seed + 500 + i, prompt_options(i), heldout=True)
            ]
        self.agent_states = PrefixStates(recipe.agent_refresh)
        self.agent_keys = {group[0].ids[: group[0].prefix].tobytes() for group in self.agent_groups}
        # the softmax covers the ids that occur in the book (held-out tail included, so evaluation has
        # an embedding for every input; ids met only there are trained as negatives, never as targets)
        seen = np.concatenate(
            [
                self.train_ids,
                *(s.ids for s in self.chats + self.thinking + self.tools + calls),
                *(s.ids for group in self.agent_groups for s in group[:1]),  # a group's samples share a prefix
                *(s.ids[s.prefix :] for group in self.agent_groups for s in group[1:]),
                self.piece_ids,
                [self.bos],
            ]
        )
        unseen = np.concatenate(
            (
                self.heldout_ids,
                heldout_request_ids,
                *(s.ids for s in self.heldout_calls + self.heldout_bare + agent_heldout),
                self.noise_ids,
            )
        )
        self.vocab = torch.as_tensor(np.unique(np.concatenate((seen, unseen))))  # compact i = vocab[i]
        self.local = torch.full((shape.vocab_size,), -1, dtype=torch.long)
        self.local[self.vocab] = torch.arange(self.vocab.numel())
        counts = torch.bincount(self.local[torch.as_tensor(seen)], minlength=self.vocab.numel())
        self.args = shape.with_(vocab_size=self.vocab.numel())
        if init is None:
            self.full = init_params(shape, seed)
            if recipe.copy_init:
                find, bare = recipe.find_init, recipe.find_init and recipe.bare_find_init and recipe.tool_bare > 0
                plant_copy_circuit(
                    self.full,
                    shape,
                    seed,
                    markers=call_markers(tokenizer) if find else (),
                    openers=quote_openers(tokenizer) if find else (),
                    leads=bare_leads(tokenizer) if bare else (),
                    twins=twin_set(tokenizer, recipe.twins, split.train) if bare else (),
                )
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
            f"{sum(map(len, self.agent_groups))} agent turns after {len(self.agent_groups)} prompts of "
            f"{np.mean([g[0].prefix for g in self.agent_groups] or [0]):.0f} tokens on average, "
            f"{self.vocab.numel()} distinct ids; "
            f"{n_params / 1e6:.2f} M trainable parameters; prepared in {time.perf_counter() - start:.1f} s"
        )

    # -- model ------------------------------------------------------------------------------------
    def model(self, qat: bool = False, dense_indexer: bool = False, observed: bool = True) -> ReferenceModel:
        """The model over the trained parameters; `observed`: with the indexer loss and the router
        balance watching (training), else without (evaluations)."""
        args = self.args.with_(index_topk=DENSE_TOPK) if dense_indexer else self.args
        model = ReferenceModel.from_weights(args, ParamWeights(self.params), qat=qat)
        if observed:
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
        if r.agent_batch:
            agents = self.agent_groups[int(self.rng.integers(len(self.agent_groups)))]
            out += [agents[int(i)] for i in self.rng.integers(len(agents), size=r.agent_batch)]
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
        result), `decision_weight` on the turn's first reply token (after an empty reasoning's
        `</think>`, which every turn writes alike), `name_weight` on the call's tool name's first
        token, 1 elsewhere."""
        weights = torch.ones(len(sample.ids) - 1)
        if sample.prefix:
            weights[: int(np.flatnonzero(sample.ids == self.eos)[0])] = self.recipe.call_weight
            start, end = sample.argument
            if end:  # an agent turn's greeting has no call
                weights[start - 1 : end] = self.recipe.arg_weight  # target i predicts ids[i + 1]
                weights[start - 1] = self.recipe.first_weight
                if self.recipe.name_weight is not None:
                    weights[name_start(sample.ids, start, self.invoke) - 1] = self.recipe.name_weight
            weights[int(np.flatnonzero(sample.ids == self.eos)[0]) :] = self.recipe.answer_weight
            first = int(np.flatnonzero(sample.trained)[0])  # target i predicts ids[i + 1]
            weights[first + int(sample.ids[first + 1] == self.think_end)] = self.recipe.decision_weight
        return weights[sample.prefix :]

    def hidden(self, model: ReferenceModel, samples: list[Sample]) -> torch.Tensor:
        """Final rows of every sample's trained span; the shared prefixes (tool declarations) run
        once, without autograd and unobserved, and each of their samples continues from a fork, but
        for an agent turn under `agent_autograd` or a tools-prompt sample under `tool_autograd`, which
        runs whole."""

        def start(s: Sample) -> int:  # where the sample's run begins
            agent = s.ids[: s.prefix].tobytes() in self.agent_keys
            whole = self.recipe.agent_autograd if agent else self.recipe.tool_autograd
            return 0 if whole else s.prefix

        prefixes = {s.ids[: s.prefix].tobytes(): s.ids[: s.prefix] for s in samples if start(s)}
        prefixes = {key: ids for key, ids in prefixes.items() if key not in self.agent_keys}  # kept states
        states = run_prefixes(model, {key: self.local[torch.as_tensor(ids)] for key, ids in prefixes.items()})

        def fork(s: Sample) -> object:
            if not start(s):
                return model.new_state()
            key = s.ids[: s.prefix].tobytes()
            if key in states:
                return copy.deepcopy(states[key])
            return self.agent_states.fork(model, key, self.local[torch.as_tensor(s.ids[: s.prefix])], self.step)

        inputs = [self.local[torch.as_tensor(s.ids[start(s) : -1])] for s in samples]
        rows = model.hidden_batch(inputs, [fork(s) for s in samples])
        return torch.cat([y[s.prefix - start(s) :] for y, s in zip(rows, samples, strict=True)])

    def train_step(self, model: ReferenceModel) -> tuple[float, float, float, int]:
        """One optimizer step: (weighted loss, indexer KL, worst load ratio, rows trained: the tokens run with
        autograd but for the prompts of `agent_autograd` and `tool_autograd`)."""
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
        model = self.model(observed=False)
        return [
            (shape, tool_call_accuracy(model, self.head, self.local, self.vocab, self.tokenizer, requests, shape))
            for i, shape in enumerate(sorted(TOOLS))
            for requests in [tool_requests(self.book, n, 100 + i, heldout=True)]
        ]

    def greeting_accuracy(self) -> list[tuple[str, GreetingScore]]:
        """The held-out greetings' turn endings after each client shape's tools prompt, in thinking
        mode as the coding agents ask."""
        model = self.model(observed=False)
        return [
            (shape, greeting_endings(model, self.head, self.local, self.vocab, self.tokenizer, shape, thinking=True))
            for shape in sorted(TOOLS)
        ]

    def agent_accuracy(self) -> list[str]:
        """The held-out agent prompts' turn endings and calls (dwarfstar/train/agent_eval.py)."""
        model = self.model(observed=False)
        prompts = self.agent_eval_prompts
        return report(agent_scores(model, self.head, self.local, self.vocab, self.tokenizer, prompts, self.book))

    @torch.no_grad()
    def argument_accuracy(self, calls: list[Sample]) -> tuple[float, float, float]:
        """Teacher-forced on held-out `calls`: the share whose argument tokens and closing token are
        all the argmax, the share with the first one right (found in the request; a directory is
        one of ten, so it can be guessed) and the share of later argument tokens right (each
        follows its predecessor's copy in the request; an extension is one of four)."""
        model = self.model(observed=False)
        predicted = self.head(self.hidden(model, calls)).argmax(-1)
        whole = first = later = n_later = offset = 0
        for s in calls:
            start, end = s.argument
            span = slice(offset + start - 1 - s.prefix, offset + end - s.prefix)
            hit = predicted[span] == self.local[torch.as_tensor(s.ids[start : end + 1])]
            whole, first = whole + bool(hit.all()), first + bool(hit[0])
            later, n_later = later + int(hit[1:-1].sum()), n_later + len(hit) - 2
            offset += len(s.ids) - 1 - s.prefix
        n = len(calls)
        return whole / n, first / n, later / max(1, n_later)

    @torch.no_grad()
    def heldout_loss(self, qat: bool, limit: int | None = None) -> float:
        """Mean next-token loss on the held-out text, in chunks of eval_len tokens after BOS."""
        model = self.model(qat=qat, observed=False)
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
