"""Training an MTP block on top of a frozen model (`tools/train_nano.py --mtp`).

The draft learns what greedy speculation checks it against: the frozen model's own next-token
choice. With the DeepSeek-V3 alignment, draft row i reads the model's final streams at position i
and the embedding of token i+1, and is trained (cross-entropy) toward the model's argmax after
position i+1, the token that verification will compare it with. The softmax runs over the ids of
the corpus only (the block shares the model's output matrix, whose other rows stay unused here).

The model's streams and choices are computed once for a fixed set of sequences (inference, QAT
rounding on, as decoding runs): windows of the book, and whole chats besides (tool round trips and
thinking turns: a block trained on prose alone never guessed a DSML token, and the agent's replies
are mostly tool calls), then the block trains over them; the block's own attention runs
without the QAT rounding, which has no gradient. The result is written in ds4's layout: a separate
GGUF of `mtp.0.*` tensors, all F32 (a few MB for the nano model).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.gguf.constants import ValueType
from dwarfstar.model import tensors as tt
from dwarfstar.model.loader import ModelFile
from dwarfstar.speculative.mtp import MTPInput
from dwarfstar.train.params import REST, ParamWeights, draft_optimizer, init_params, write_f32


@dataclass(frozen=True)
class MTPRecipe:
    steps: int = 500
    sequences: int = 384  # distinct training sequences, the model's streams computed once for each
    seq_len: int = 160
    batch: int = 4
    lr: float = 2e-3


class MTPTrainer:
    def __init__(
        self,
        model: ModelFile,
        token_ids: np.ndarray,
        bos: int,
        recipe: MTPRecipe,
        seed: int,
        chats: Sequence[np.ndarray] = (),
    ) -> None:
        """`token_ids`: running text, cut into `recipe.sequences` windows after BOS; `chats`: whole
        rendered sequences (from BOS) trained as they are."""
        self.recipe, self.model = recipe, model
        args = model.args
        self.trunk = ReferenceModel(model, qat=True)
        self.block_args = tt.mtp_block_args(args)
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, len(token_ids) - recipe.seq_len, recipe.sequences)
        self.samples = [np.concatenate(([bos], token_ids[s : s + recipe.seq_len - 1])) for s in starts]
        self.samples += [np.asarray(chat, dtype=np.int64) for chat in chats]
        self.vocab = torch.as_tensor(np.unique(np.concatenate((token_ids, *self.samples))))  # samples start with BOS
        local = torch.full((args.vocab_size,), -1, dtype=torch.long)
        local[self.vocab] = torch.arange(self.vocab.numel())
        self.streams, self.choices = [], []
        for sample in self.samples:  # the frozen model, once: streams [T, n, D], its argmax per position
            logits, streams = self.trunk.forward_streams(sample.tolist(), self.trunk.new_state())
            self.streams.append(streams.clone())
            self.choices.append(local[logits.argmax(-1)])
        params = init_params(self.block_args, seed)
        params.pop(REST)  # the trainer's stand-in row for unseen ids: the block shares the real output matrix
        for shared in (tt.EMBED, tt.OUTPUT):  # the model's, frozen
            params[shared] = self.trunk.ops.embedding if shared == tt.EMBED else self.trunk.ops.output
        gen = torch.Generator().manual_seed(seed + 1)
        d = args.dim
        self.input_params = {
            "enorm.weight": torch.ones(d),
            "hnorm.weight": torch.ones(d),
            "e_proj.weight": torch.randn(d, d, generator=gen) / d**0.5,
            "h_proj.weight": torch.randn(d, d, generator=gen) / d**0.5,
        }
        self.params = params
        self.opt = draft_optimizer([*params.items(), *self.input_params.items()], recipe.lr)
        self.rng = rng
        self.step = 0

    def mix(self) -> MTPInput:
        p = self.input_params
        norms = (p["enorm.weight"], p["hnorm.weight"])
        return MTPInput(norms, (p["e_proj.weight"], p["h_proj.weight"]), self.model.args.norm_eps, None)

    def sample_loss(self, draft: ReferenceModel, i: int) -> tuple[torch.Tensor, float]:
        """Cross-entropy of the draft toward the model's choices on sample i, and its top-1 agreement."""
        tokens, streams, choices = self.samples[i], self.streams[i], self.choices[i]
        batch = draft.batch([tokens[1:].tolist()], [draft.new_state()])
        mix = self.mix()
        h = draft.run_layers(mix(draft.embed(batch), streams[:-1]), batch)
        y, _ = draft.head(h, batch, True)
        logits = y @ self.params[tt.OUTPUT][self.vocab].T
        target = choices[1:]  # -1 where the model chose an id outside the corpus: no target there
        loss = F.cross_entropy(logits, target, ignore_index=-1)
        valid = target >= 0
        return loss, float((logits.argmax(-1) == target)[valid].float().mean())

    def train_step(self) -> tuple[float, float]:
        r = self.recipe
        lr = r.lr * min(1.0, (self.step + 1) / 20) * (0.1 + 0.9 * (1 - self.step / r.steps))
        for group in self.opt.param_groups:
            group["lr"] = lr
        draft = ReferenceModel.from_weights(self.block_args, ParamWeights(self.params), qat=False)
        losses, agree = [], []
        for i in self.rng.integers(0, len(self.samples), r.batch):
            loss, hits = self.sample_loss(draft, int(i))
            losses.append(loss)
            agree.append(hits)
        total = torch.stack(losses).mean()
        self.opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_([t for g in self.opt.param_groups for t in g["params"]], 1.0)
        self.opt.step()
        self.step += 1
        return float(total.detach()), float(np.mean(agree))

    def export(self, path: str | os.PathLike) -> None:
        """ds4's separate MTP file: the block, its head and its input tensors under `mtp.0.`."""
        args = self.model.args
        names = tt.mtp_block_names(args, "ds4")
        tensors = {names[own]: t for own, t in self.params.items() if own in names}
        tensors.update({tt.MTP_PREFIX + name: t for name, t in self.input_params.items()})
        metadata = args.to_gguf_metadata()
        metadata["general.name"] = (ValueType.STRING, "nano-mtp")
        write_f32(path, metadata, list(tt.mtp_tensors(args, "ds4")), tensors)


def train_mtp(
    model: ModelFile,
    token_ids: np.ndarray,
    bos: int,
    recipe: MTPRecipe,
    seed: int,
    log: Callable[[str], None],
    chats: Sequence[np.ndarray] = (),
) -> MTPTrainer:
    trainer = MTPTrainer(model, token_ids, bos, recipe, seed, chats)
    log(f"mtp: {recipe.sequences} windows of {recipe.seq_len} and {len(chats)} chats, {trainer.vocab.numel()} ids")
    while trainer.step < recipe.steps:
        loss, agree = trainer.train_step()
        if trainer.step % 20 == 0 or trainer.step == recipe.steps:
            log(f"mtp step {trainer.step}/{recipe.steps} loss {loss:.3f} top-1 agreement {agree:.3f}")
    return trainer
