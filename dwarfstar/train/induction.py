"""A copy (induction) circuit planted in the initial weights of a DeepSeek V4 model, so that copying
text from the context is there from the first step instead of forming late, or never, in a short run.

Why it forms slowly here: an induction head is the product of two circuits that each help only once
the other works (a previous-token head, then a head matching the current token against the token
before each earlier position), and V4 has no bias anywhere, so a purely positional head needs a
content-independent direction in the residual that random embeddings do not have. Probes of 150 steps
of copy sequences alone from a random start left every head of the nano model attending uniformly and
the copy loss at ln(vocabulary) (learning rate 1e-2, runs of 3 to 10 tokens, 16 pieces instead of
128, sharper attention at init: the same); one planted previous-token head did not change that.
With the whole circuit planted, the same probe predicts 44% of held-out copy tokens (pieces never
trained as copies) after 25 steps and 99% after 100, and held-out tool-call arguments, teacher-forced,
get 74% of their later tokens right without ever having seen a call.

The circuit (an initialisation only: every weight it sets trains as usual):

- the residual is split by an orthogonal basis into a constant direction `u`, a token subspace
  (the embeddings: `u` times `const` plus a random code), a previous-token subspace and, in a model
  wider than 1 + 2 * 47 dims, the rest (more random embedding dims, which the circuit does not read);
- layer 0, head 0 is positional: its query and the rope part of the shared K=V row read `u`, rotated
  so that the score peaks at the previous position; the row's other dims are the token code, which
  the head's output writes into the previous-token subspace;
- layer 1 (window-only, so no compressed rows compete), head 0 matches: its query is the current
  token's code, the key half of the K=V row is the previous-token subspace (both through the same
  random projection), and the value half of the row is the token's own code, which the output
  writes into the residual in the output head's space;
- the output head is the embedding minus its constant seen through a random rotation `G`
  (`output[y] = scale * G e_y`),
  so the copied code raises the copied token's logit, and the current token's own embedding does not
  raise its own;
- with markers and openers (a tool call: the `">` that ends `string="true">`, and the request's
  opening `` ` `` or ` "`), layer 1's head 1 finds where the copy starts: its query at a marker is the
  openers' code in the key half (previous-token codes), so it attends to the token after an opener
  and copies its value like head 0. The matching head cannot find that first token (the marker has
  no earlier occurrence), and gradient alone found it late or never: in the full recipe, held-out
  arguments' first token teacher-forced, 3% after 100 steps without this head (2% at step 400 and 5%
  at step 800 in a full run; 33% and 100% in another), 88% after 100 steps and 95% after 150 with it;
- with twins and leads (a bare request: `search for divorato`, whose argument starts with ` divor`
  after the template's last word ` for`, while the call's value starts with `divor`), each twin pair
  (` X`, `X`) shares one code, `X`'s with the component along a "space" direction `s` of the value
  half flipped, and layer 1's head 2 finds the bare start: its query at a marker is the leads' code in
  the key half, so it attends to the token after a lead, and its output reflects the copied code's
  `s` component, so copying ` X` raises `X`. A linear head cannot map 2,500 unrelated code pairs (a
  23-dim value), which is why the twins share their code: the map is then one reflection for all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dwarfstar.backends.reference import ops
from dwarfstar.model.config import ModelArgs, yarn_inv_freq
from dwarfstar.model.numerics import rope_angles

# weights of the first four rope pairs in the positional score: with the base-10000 frequencies
# (1, 0.32, 0.1, 0.03 rad per token) their cosines peak together at one token back and stay at most
# 0.8 of the peak elsewhere in a 64-token window
PAIR_WEIGHTS = (0.4, 0.28, 0.2, 0.12)


@dataclass(frozen=True)
class CopyInit:
    const: float = 6.0  # norm of the constant direction in every embedding
    code_norm: float = 9.6  # norm of an embedding's random token code
    prev_sharpness: float = 4.0  # kv-norm weight of layer 0's rope dims (the previous-token score scale)
    prev_gain: float = 1.5  # how strongly layer 0 writes the previous token's code
    key_dims: int = 24  # of the matching head's 48 non-rope dims: key half, the rest is the value
    match_sharpness: float = 4.0  # kv-norm weight of the matching head's key dims
    copy_gain: float = 2.0  # how strongly layer 1 writes the copied code
    output_scale: float = 0.1  # output rows: scale * G e_y (a random init row has norm ~1)
    # the finding head's query: weight of the marker match, and of a constant part pointing at a key
    # dim that is always 0 (a larger one, with a sink logit of ~8, would also keep other tokens off
    # the opener; these weights leave that to training: the head is not gated at init)
    find_gain: float = 3.0
    find_null: float = 1.0
    # a twin pair's codes: sqrt(1 - twin_space**2) of a shared code, twin_space along +s (` X`) or -s (`X`)
    twin_space: float = 0.5
    lead_share: float = 0.6  # a lead's code: sqrt(1 - lead_share**2) of its own, lead_share along the shared one


@torch.no_grad()
def plant_copy_circuit(
    params: dict[str, torch.Tensor],
    args: ModelArgs,
    seed: int,
    init: CopyInit = CopyInit(),
    *,
    markers: Sequence[int] = (),
    openers: Sequence[int] = (),
    leads: Sequence[int] = (),
    twins: Sequence[tuple[int, int]] = (),
) -> None:
    """Set the circuit's weights in `params` (full-vocabulary initial parameters, in place).

    With `markers` and `openers` (token ids), layer 1's head 1 finds where a copy starts: at a
    marker it attends to the token after an opener and copies it. With `leads` and `twins` (pairs of
    ids: ` X`, `X`) too, head 2 at a marker attends to the token after a lead and writes its twin."""
    gen = torch.Generator().manual_seed(seed + 7919)
    d, hd, rope = args.dim, args.head_dim, args.rope_dim
    nope = hd - rope
    n_tok = nope - 1  # token code dims: the previous-token subspace holds the same number
    if 1 + 2 * n_tok > d:
        raise ValueError(f"hidden {d} cannot hold a constant, a {n_tok}-dim token code and its copy")
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    basis = basis.float()
    u, tok, prev = basis[:, 0], basis[:, 1 : 1 + n_tok], basis[:, 1 + n_tok : 1 + 2 * n_tok]
    free = basis[:, 1 + 2 * n_tok :]  # the rest of a wider model: more random embedding dims
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    rotation = rotation.float()

    # embeddings: constant + random token code; output rows: the code through the rotation
    embd = params["token_embd.weight"]
    codes = torch.randn(embd.shape[0], n_tok, generator=gen) * (init.code_norm / math.sqrt(n_tok))
    extra = torch.randn(embd.shape[0], free.shape[1], generator=gen) * (init.code_norm / math.sqrt(n_tok))
    key = torch.linalg.qr(torch.randn(n_tok, n_tok, generator=gen, dtype=torch.float64))[0].float()
    k_rows, v_rows = key[: init.key_dims], key[init.key_dims :]  # layer 1's projections of the code
    space = torch.randn(len(v_rows), generator=torch.Generator().manual_seed(seed + 104729))
    space /= space.norm()  # the "space" direction in the value half's coordinates
    if twins:
        spaced, bare = (list(ids) for ids in zip(*twins, strict=True))
        shared = codes[spaced] * math.sqrt(1 - init.twin_space**2)
        flip = (init.twin_space * init.code_norm) * (v_rows.T @ space)
        codes[spaced], codes[bare] = shared + flip, shared - flip
    if leads:  # they share a component of their codes in the key half, so that one query finds them all
        ids = list(leads)  # (a query summing a dozen random codes would match each 1/sqrt(12) as well)
        lead = k_rows.T @ (k_rows @ codes[ids].sum(0))
        lead /= lead.norm()
        own = math.sqrt(1 - init.lead_share**2)
        codes[ids] = own * codes[ids] + (init.lead_share * init.code_norm) * lead
    body = codes @ tok.T + extra @ free.T
    params["token_embd.weight"] = init.const * u + body
    params["output.weight"] = init.output_scale * body @ rotation.T

    # layer 0, head 0: previous-token head
    p = "blk.0."
    a = torch.zeros(rope)
    for i, w in enumerate(PAIR_WEIGHTS):
        a[2 * i] = math.sqrt(w)
    inv = torch.tensor(yarn_inv_freq(args, args.layer(0)))
    cos, sin = rope_angles(torch.tensor([1]), inv)
    b = ops.apply_rope(a[None], cos, sin)[0]  # the query's rope vector one position on
    q_a = params[p + "attn_q_a.weight"]
    q_a[0] = u
    q_b = params[p + "attn_q_b.weight"]
    q_b[:hd] = 0
    q_b[hd - rope : hd, 0] = a * 8
    kv = params[p + "attn_kv.weight"]
    kv[:n_tok] = tok.T  # the token code
    kv[n_tok:nope] = 0
    kv[nope:] = torch.outer(b * 1.6 / b.norm(), u)
    params[p + "attn_kv_a_norm.weight"][nope:] = init.prev_sharpness
    wo_a, wo_b = params[p + "attn_output_a.weight"], params[p + "attn_output_b.weight"]
    rank = args.o_lora_rank
    wo_a[:n_tok] = 0
    wo_a[:n_tok, :n_tok] = torch.eye(n_tok)  # group 0 rows read head 0's token code
    wo_a[n_tok:rank, :hd] = 0  # head 0 writes nothing else
    wo_b[:, :n_tok] = init.prev_gain * prev

    # layer 1, head 0: match the current token against the previous-token subspace, copy the code
    p = "blk.1."
    q_a = params[p + "attn_q_a.weight"]
    q_a[:n_tok] = tok.T  # the current token's code
    q_b = params[p + "attn_q_b.weight"]
    q_b[:hd] = 0
    q_b[: init.key_dims, :n_tok] = k_rows * 4
    kv = params[p + "attn_kv.weight"]
    kv[: init.key_dims] = k_rows @ prev.T  # key: the previous token's code
    kv[init.key_dims : init.key_dims + len(v_rows)] = v_rows @ tok.T  # value: the token's own code
    kv[init.key_dims + len(v_rows) : nope] = 0
    kv[nope:] *= 0.3
    params[p + "attn_kv_a_norm.weight"][: init.key_dims] = init.match_sharpness
    wo_a, wo_b = params[p + "attn_output_a.weight"], params[p + "attn_output_b.weight"]
    n_v = len(v_rows)
    wo_a[:n_v] = 0
    wo_a[:n_v, init.key_dims : init.key_dims + n_v] = torch.eye(n_v)
    wo_a[n_v:rank, :hd] = 0
    wo_b[:, :n_v] = init.copy_gain * (rotation @ tok @ v_rows.T)

    if not markers:
        return
    # layer 1, head 1: at a marker token, find the token after an opener and copy it (the first token
    # of a copy, which the matching head cannot find: no earlier occurrence of the marker precedes it)
    const_row = n_tok  # a latent dim of the query LoRA reading the constant direction
    q_a[const_row] = u
    marker = codes[list(markers)].sum(0)
    opener = codes[list(openers)].sum(0)
    query = k_rows @ (opener / opener.norm())  # in the key half: the opener's code as a previous token
    q_b[hd : 2 * hd] = 0
    q_b[hd : hd + init.key_dims, :n_tok] = init.find_gain * torch.outer(query / query.norm(), marker / marker.norm())
    q_b[hd + nope - 1, const_row] = init.find_null  # elsewhere the query points at a key dim that is always 0
    wo_a[:n_v, hd + init.key_dims : hd + init.key_dims + n_v] = torch.eye(n_v)  # its value into the copy's output
    wo_a[n_v:rank, hd : 2 * hd] = 0

    if not leads:
        return
    # layer 1, head 2 (output group 1): at a marker, find the token after a lead (a bare argument's
    # first token, ` X`) and write its code with the space component flipped: its twin `X`
    query = k_rows @ lead
    q_b[2 * hd : 3 * hd] = 0
    q_b[2 * hd : 2 * hd + init.key_dims, :n_tok] = init.find_gain * torch.outer(
        query / query.norm(), marker / marker.norm()
    )
    q_b[2 * hd + nope - 1, const_row] = init.find_null
    group = slice(rank, rank + n_v)
    wo_a[rank : 2 * rank, :hd] = 0  # head 2 is read by the group's first rows only, through the reflection
    wo_a[group] = 0
    wo_a[group, init.key_dims : init.key_dims + n_v] = torch.eye(n_v) - 2 * torch.outer(space, space)
    wo_b[:, group] = init.copy_gain * (rotation @ tok @ v_rows.T)
