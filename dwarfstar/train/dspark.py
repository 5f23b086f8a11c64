"""Training a DSpark drafter on top of a frozen model (`tools/train_nano.py --dspark`).

As for the MTP block (dwarfstar/train/mtp.py), the drafter learns what greedy verification checks it
against: the frozen model's own choices. The model's streams at the drafter's target layers and its
argmax at every position are computed once for a fixed set of sequences (book windows and chats,
QAT rounding on, as decoding runs). A step then takes a few sequences; in each, anchors at random
positions a: the context rows of the positions before a go into the stages' rings (main_x through
the trainable projection), the block [token a, noise...] runs through the stages, and row i is
trained (cross-entropy) toward the model's choice after position a + i, with the Markov bias of the
model's choice before it (the anchor for the first row: teacher forcing, as at drafting time the
drafts before it are the ones kept when it is accepted). The confidence head learns whether the row's
own argmax is that choice (binary cross-entropy, its input detached, so it only reads the drafter).

The book windows are short prompts that the frozen model continues greedily, and anchors are taken
only inside the continuation: there a block's tokens after its anchor are the model's own choices,
as they are when greedy drafting is accepted. On book text they are the book's, which the block never
sees (its rows after the first are noise tokens), so the targets of every row but the first would
depend on words the drafter cannot know. The chats are taken as written (anchors anywhere).

The forward is the drafter's own (`dwarfstar.model.dspark.DSparkForward`) over the reference backend
built on the trainable tensors. The softmax runs over the corpus ids, the output matrix the model's.
The result is ds4's support file: `mtp.{k}.*` tensors, F32.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model import tensors as tt
from dwarfstar.model.dspark import (
    CONFIDENCE,
    MAIN,
    MARKOV,
    PREFIX,
    DSparkArgs,
    DSparkForward,
    DSparkHeads,
    dspark_tensors,
    stage_args,
    stage_names,
    support_metadata,
)
from dwarfstar.model.loader import ModelFile
from dwarfstar.speculative.decode import capturing
from dwarfstar.train.params import REST, ParamWeights, draft_optimizer, init_params, write_f32


@dataclass(frozen=True)
class DSparkRecipe:
    steps: int = 300
    sequences: int = 256  # distinct training sequences, the model's streams computed once for each
    seq_len: int = 160
    prompt_tokens: tuple[int, int] = (16, 96)  # book tokens a window keeps before the model continues it
    batch: int = 4  # sequences per step
    anchors: int = 6  # blocks per sequence per step
    lr: float = 2e-3
    confidence_weight: float = 0.2


class DSparkTrainer:
    def __init__(
        self,
        model: ModelFile,
        d: DSparkArgs,
        token_ids: np.ndarray,
        bos: int,
        recipe: DSparkRecipe,
        seed: int,
        chats: Sequence[np.ndarray] = (),
        init: str | os.PathLike | None = None,
    ) -> None:
        """`init`: a support file this drafter continues from (its F32 export), else a random start."""
        self.recipe, self.model, self.d = recipe, model, d
        args = model.args
        trunk = ReferenceModel(model, qat=True)
        self.stage_args = stage_args(args, d)
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, len(token_ids) - recipe.seq_len, recipe.sequences)
        lengths = rng.integers(recipe.prompt_tokens[0], recipe.prompt_tokens[1] + 1, recipe.sequences)
        prompts = [np.concatenate(([bos], token_ids[s : s + n])) for s, n in zip(starts, lengths, strict=True)]
        self.samples = continue_greedily(trunk, prompts, recipe.seq_len)
        self.first_anchor = [len(p) for p in prompts]  # the first token the model chose
        self.samples += [np.asarray(chat, dtype=np.int64) for chat in chats]
        self.first_anchor += [1] * len(chats)
        self.vocab = torch.as_tensor(np.unique(np.concatenate((token_ids, *self.samples, [d.noise_token_id]))))
        self.local = torch.full((args.vocab_size,), -1, dtype=torch.long)
        self.local[self.vocab] = torch.arange(self.vocab.numel())
        self.captured, self.choices = [], []
        for sample in self.samples:  # the frozen model, once: its target layers' streams, its argmax
            with capturing(trunk, d.target_layers) as captured:
                logits, _ = trunk.forward_streams(sample.tolist(), trunk.new_state())
            self.captured.append([captured[il].clone() for il in d.target_layers])
            self.choices.append(logits.argmax(-1).clone())
        params = init_params(self.stage_args, seed)
        params.pop(REST)
        for shared in (tt.EMBED, tt.OUTPUT):  # the model's, frozen
            params[shared] = trunk.ops.embedding if shared == tt.EMBED else trunk.ops.output
        gen = torch.Generator().manual_seed(seed + 1)
        dim, rank, layers = args.dim, d.markov_rank, len(d.target_layers)
        self.head_params = {
            MAIN[0]: torch.randn(dim, layers * dim, generator=gen) / (layers * dim) ** 0.5,
            MAIN[1]: torch.ones(dim),
            MARKOV[0]: torch.randn(args.vocab_size, rank, generator=gen) / rank**0.5,
            MARKOV[1]: torch.zeros(args.vocab_size, rank),
            CONFIDENCE: torch.zeros(1, dim + rank),
        }
        self.params = params
        if init is not None:
            self._load(init)
        self.opt = draft_optimizer([*params.items(), *self.head_params.items()], recipe.lr)
        self.rng = rng
        self.step = 0

    def _load(self, path: str | os.PathLike) -> None:
        """The trainable tensors' values from a support file of this drafter's shapes."""
        args, d = self.model.args, self.d
        names = {own: name for own, name in stage_names(args, d).items() if own in self.params}
        first, last = PREFIX.format(0), PREFIX.format(d.stages - 1)
        heads = {name: first + name for name in MAIN} | {name: last + name for name in (*MARKOV, CONFIDENCE)}
        with GGUFFile(path) as gguf:
            missing = sorted((set(names.values()) | set(heads.values())) - gguf.tensors.keys())
            if missing:
                raise ModelFileError(f"{path} is not a support file of this drafter: no {', '.join(missing[:3])}")
            for own, name in names.items():
                self.params[own].data.copy_(gguf.tensor(name).reshape(self.params[own].shape))
            for own, name in heads.items():
                self.head_params[own].data.copy_(gguf.tensor(name).reshape(self.head_params[own].shape))

    def heads(self) -> DSparkHeads:
        p = self.head_params
        return DSparkHeads(p[MAIN[0]], p[MAIN[1]], p[MARKOV[0]], p[MARKOV[1]], p[CONFIDENCE], self.model.args.norm_eps)

    def sample_loss(self, forward: DSparkForward, i: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """(cross-entropy, confidence loss, each row's top-1 agreement) of blocks at random anchors of sample i."""
        tokens, choices, heads, b = self.samples[i], self.choices[i], self.heads(), self.d.block_size
        main_x = heads.main_x(self.captured[i])
        room = np.arange(self.first_anchor[i], len(tokens) - b)
        anchors = np.sort(self.rng.choice(room, min(self.recipe.anchors, len(room)), replace=False))
        state, done = forward.new_state(), 0
        ce, bce, hits = [], [], []  # hits: per row, over the blocks
        for a in anchors.tolist():
            forward.context(main_x[done:a], state)  # positions before the anchor
            done = a
            collapsed, logits = forward.block(int(tokens[a]), state)
            previous = torch.cat((torch.as_tensor(tokens[a : a + 1]), choices[a : a + b - 1]))
            e = heads.markov_w1[previous]  # [b, rank]
            rows = logits[:, self.vocab] + e @ heads.markov_w2[self.vocab].T
            target = self.local[choices[a : a + b]]
            ce.append(F.cross_entropy(rows, target, ignore_index=-1))
            right = (rows.argmax(-1) == target).float()
            confidence = torch.cat((collapsed.detach(), e.detach()), -1) @ heads.confidence[0]
            bce.append(F.binary_cross_entropy_with_logits(confidence, right))
            hits.append(right.numpy())
        return torch.stack(ce).mean(), torch.stack(bce).mean(), np.mean(hits, axis=0)

    def train_step(self) -> tuple[float, float, np.ndarray]:
        """One optimizer step: (cross-entropy, confidence loss, each row's top-1 agreement)."""
        r = self.recipe
        lr = r.lr * min(1.0, (self.step + 1) / 20) * (0.1 + 0.9 * (1 - self.step / r.steps))
        for group in self.opt.param_groups:
            group["lr"] = lr
        stages = ReferenceModel.from_weights(self.stage_args, ParamWeights(self.params), qat=False)
        forward = DSparkForward(stages, self.d)
        ce, bce, hits = [], [], []
        for i in self.rng.integers(0, len(self.samples), r.batch):
            c, b, h = self.sample_loss(forward, int(i))
            ce.append(c)
            bce.append(b)
            hits.append(h)
        ce_mean, bce_mean = torch.stack(ce).mean(), torch.stack(bce).mean()
        self.opt.zero_grad()
        (ce_mean + r.confidence_weight * bce_mean).backward()
        torch.nn.utils.clip_grad_norm_([t for g in self.opt.param_groups for t in g["params"]], 1.0)
        self.opt.step()
        self.step += 1
        return float(ce_mean.detach()), float(bce_mean.detach()), np.mean(hits, axis=0)

    def export(self, path: str | os.PathLike, matrices: GGMLType = GGMLType.F32) -> None:
        """ds4's support file: the stages, their head and the DSpark heads under `mtp.{k}.`, the
        matrices in `matrices` (F32 or Q8_0), the rest F32."""
        args, d = self.model.args, self.d
        names = stage_names(args, d)
        tensors = {names[own]: t for own, t in self.params.items() if own in names}
        first, last = PREFIX.format(0), PREFIX.format(d.stages - 1)
        tensors.update({first + name: self.head_params[name] for name in MAIN})
        tensors.update({last + name: self.head_params[name] for name in (*MARKOV, CONFIDENCE)})
        write_f32(path, support_metadata(d, "nano-dspark"), list(dspark_tensors(args, d)), tensors, matrices)


@torch.inference_mode()
def continue_greedily(model: ReferenceModel, prompts: Sequence[np.ndarray], length: int) -> list[np.ndarray]:
    """Each prompt followed by the model's greedy tokens up to `length` tokens, all decoding together."""
    states = [model.new_state() for _ in prompts]
    out = [list(p) for p in prompts]
    calls = [list(p) for p in prompts]
    while True:
        live = [i for i, seq in enumerate(out) if len(seq) < length]
        if not live:
            return [np.asarray(seq, dtype=np.int64) for seq in out]
        logits = model.forward_batch([calls[i] for i in live], [states[i] for i in live])
        for i, row in zip(live, logits, strict=True):
            calls[i] = [int(row[-1].argmax())]
            out[i].append(calls[i][0])


def train_dspark(
    model: ModelFile,
    d: DSparkArgs,
    token_ids: np.ndarray,
    bos: int,
    recipe: DSparkRecipe,
    seed: int,
    log: Callable[[str], None],
    chats: Sequence[np.ndarray] = (),
    save: Callable[[DSparkTrainer], None] | None = None,
    save_every: int = 200,
    init: str | os.PathLike | None = None,
) -> DSparkTrainer:
    """Train `recipe.steps` steps (from the drafter in `init`, if given), logging every 20 and calling
    `save(trainer)` every `save_every`."""
    trainer = DSparkTrainer(model, d, token_ids, bos, recipe, seed, chats, init)
    log(f"dspark: {recipe.sequences} windows of {recipe.seq_len} and {len(chats)} chats, {trainer.vocab.numel()} ids")
    while trainer.step < recipe.steps:
        ce, bce, agree = trainer.train_step()
        if trainer.step % 20 == 0 or trainer.step == recipe.steps:
            rows = " ".join(f"{a:.2f}" for a in agree)
            log(f"dspark step {trainer.step}/{recipe.steps} ce {ce:.3f} confidence {bce:.3f} top-1 by row {rows}")
        if save is not None and trainer.step % save_every == 0 and trainer.step < recipe.steps:
            save(trainer)
    return trainer
