"""`tools/train_nano.py --mtp`'s trainer: a step moves the block and not the model, and the exported
file is ds4's MTP layout, loaded back exactly."""

from __future__ import annotations

import numpy as np
import torch

from dwarfstar.model import tensors as tt
from dwarfstar.model.loader import open_model
from dwarfstar.speculative.mtp import load_draft
from dwarfstar.train.mtp import MTPRecipe, MTPTrainer


def test_trained_block_round_trips_through_its_file(mtp_files, engines, tmp_path):
    model = open_model(mtp_files["plain"])
    # a corpus holding every id once: the softmax then covers whatever the random model chooses
    ids = np.random.default_rng(0).permutation(np.arange(3, model.args.vocab_size))
    trainer = MTPTrainer(model, ids, 0, MTPRecipe(steps=2, sequences=2, seq_len=24, batch=1), seed=0)
    embedding = trainer.params[tt.EMBED].clone()
    before = trainer.input_params["h_proj.weight"].detach().clone()
    trainer.train_step()
    trainer.train_step()
    assert torch.equal(trainer.params[tt.EMBED], embedding)  # the model's own weights stay frozen
    assert not torch.equal(trainer.input_params["h_proj.weight"], before)

    path = tmp_path / "mtp.gguf"
    trainer.export(path)
    engine = engines("reference", "plain")
    draft = load_draft(engine.backend, engine.model, path)
    assert torch.equal(draft.mix.h_proj, trainer.input_params["h_proj.weight"].detach())
    q_a = tt.layer_tensor(0, "attn_q_a.weight")
    assert torch.equal(draft.model.ops.layers[0].proj["q_a"], trainer.params[q_a].detach())
