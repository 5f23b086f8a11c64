"""Image blocks through the session (issue 34) on the reference backend, tiny model with image biases: a
pass never splits a block whatever the chunk size, marks or call split; a cut before or after a block
replays it exactly; a cut inside one is refused; content ids keep two images from sharing a prefix; ids
past the vocabulary outside a block are refused; snapshots, batched prefill and the wrappers carry spans."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.distributed.backend import RouteBackend
from dwarfstar.distributed.protocol import DistError
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.image_spans import ImageSpan, content_ids
from dwarfstar.model.synthetic import TINY
from dwarfstar.prompt.image_layout import ExpToken
from dwarfstar.session.prefix import common_prefix_len
from dwarfstar.session.session import Session, prefill_batch
from dwarfstar.session.throttle import DutyCycle, ThrottledBackend

VOCAB = TINY.vocab_size
TEXT = torch.randint(3, 120000, (120,), generator=torch.Generator().manual_seed(5)).tolist()
TOL = 1e-5  # fp32 noise between differently split passes, relative to the largest logit
A_AT, A_LEN, B_AT, B_LEN = 40, 19, 75, 11  # two blocks: 40..58 and 75..85


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return ((a - b).abs().max() / b.abs().max()).item() < TOL


def image(name: bytes, length: int, seed: int, at: int = 0) -> tuple[list[int], ImageSpan]:
    """A block's content ids and its span (at `at`): random rows, START..END after one leading PAD."""
    rows = torch.randn(length, TINY.dim, generator=torch.Generator().manual_seed(seed))
    return content_ids(name, length, VOCAB), ImageSpan(at, rows, (1, length - 1))


A_IDS, A = image(b"image a", A_LEN, 1, A_AT)
B_IDS, B = image(b"image b", B_LEN, 2, B_AT)
PROMPT = TEXT[:A_AT] + A_IDS + TEXT[A_AT : B_AT - A_LEN] + B_IDS + TEXT[B_AT - A_LEN : 110 - A_LEN - B_LEN]
N = len(PROMPT)


def shifted(spans: list[ImageSpan], by: int) -> list[ImageSpan]:
    return [ImageSpan(s.offset + by, s.rows, s.attend) for s in spans]


@pytest.fixture(scope="module")
def want(image_model) -> torch.Tensor:
    """The next-token logits after PROMPT from one pass."""
    return image_model.forward(PROMPT, image_model.new_state(), all_logits=False, images=[A, B])[-1]


def test_prompt_holds_the_blocks():
    assert PROMPT[A_AT : A_AT + A_LEN] == A_IDS and PROMPT[B_AT : B_AT + B_LEN] == B_IDS
    assert all(t < VOCAB for i, t in enumerate(PROMPT) if not (A_AT <= i < A.stop or B_AT <= i < B.stop))


@pytest.mark.parametrize("chunk", [3, 7, 16, 45, 64, 4096])
def test_chunk_size_never_splits_a_block(image_model, want, chunk):
    """Chunk sizes whose boundaries fall inside a block: the same logits; no checkpoint inside a block;
    a block that started a pass and ran over a boundary leaves its checkpoint just after it."""
    session = Session(image_model, ctx=1024, chunk=chunk)
    assert close(session.prefill(PROMPT, images=[A, B]), want)
    assert session.stats.computed == N
    for span in (A, B):
        assert not [c for c in session.checkpoints if span.offset < c < span.stop], chunk
        if span.offset // chunk < (span.stop - 1) // chunk:  # a boundary inside it
            assert span.stop in session.checkpoints, chunk
    assert [(s.offset, s.length) for s in session.images] == [(A_AT, A_LEN), (B_AT, B_LEN)]


@pytest.mark.parametrize("cuts", [(A_AT,), (A.stop,), (10, A.stop + 3, B_AT), (A.stop, B.stop, N - 1)])
def test_any_call_split_gives_the_same_logits(image_model, want, cuts):
    session = Session(image_model, ctx=1024, chunk=16)
    bounds = [0, *cuts, N]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        mine = [s for s in (A, B) if lo <= s.offset < hi]
        session.prefill(PROMPT[lo:hi], images=shifted(mine, -lo))
    assert session.tokens == PROMPT and close(session.logits, want)


def test_a_call_that_cuts_a_block_is_refused_whole(image_model):
    session = Session(image_model, ctx=1024, chunk=16)
    with pytest.raises(DwarfStarError, match="inside the call"):
        session.prefill(PROMPT[: A_AT + 5], images=[A])
    assert session.tokens == [] and session.images == []


def test_marks_inside_a_block_keep_their_checkpoint_after_it(image_model, want):
    session = Session(image_model, ctx=1024, chunk=4096)
    session.mark([A_AT + 5, 70])
    assert close(session.prefill(PROMPT, images=[A, B]), want)
    assert session.checkpoints == [A.stop, 70]


def fresh(image_model, calls: list[tuple[int, int]], chunk: int = 16) -> Session:
    """A new session given PROMPT[lo:hi] call by call, each with its blocks."""
    session = Session(image_model, ctx=1024, chunk=chunk)
    for lo, hi in calls:
        session.prefill(PROMPT[lo:hi], images=shifted([s for s in (A, B) if lo <= s.offset < hi], -lo))
    return session


@pytest.mark.parametrize("keep", [A_AT, A_AT - 3, A.stop, A.stop + 2, B_AT, B.stop + 4])
def test_truncate_before_or_after_a_block_replays_it_exactly(image_model, keep):
    """Cut back, check the state against a fresh session given the same calls bit for bit, then prefill
    the rest: bit-identical to a fresh session that split its calls at the same place."""
    session = fresh(image_model, [(0, N)], chunk=32)  # the checkpoints at 32 and 64 sit before/between blocks
    session.truncate(keep)
    assert session.tokens == PROMPT[:keep]
    assert [s.stop for s in session.images] == [s.stop for s in (A, B) if s.stop <= keep]
    assert torch.equal(session.logits, fresh(image_model, [(0, keep)], chunk=32).logits)
    rest = [s for s in (A, B) if s.offset >= keep]
    session.prefill(PROMPT[keep:], images=shifted(rest, -keep))
    assert torch.equal(session.logits, fresh(image_model, [(0, keep), (keep, N)], chunk=32).logits)


def test_a_replay_reruns_the_block_from_a_checkpoint_before_it(image_model):
    """chunk 64: the last checkpoint before A.stop + 2 is 0, so the replay runs A again from the kept span."""
    session = fresh(image_model, [(0, N)], chunk=64)
    computed = session.stats.computed
    session.truncate(A.stop + 2)
    assert session.stats.computed - computed == A.stop + 2
    assert torch.equal(session.logits, fresh(image_model, [(0, A.stop + 2)], chunk=64).logits)


def test_truncate_inside_a_block_is_refused(image_model):
    session = fresh(image_model, [(0, N)])
    before = (list(session.tokens), session.logits.clone())
    for cut in (A_AT + 1, A.stop - 1, B_AT + 5):
        with pytest.raises(DwarfStarError, match="image block"):
            session.truncate(cut)
    assert session.tokens == before[0] and torch.equal(session.logits, before[1])


def test_two_images_share_no_prefix_past_the_block_start(image_model):
    """A session holding image A, given a prompt with image B (other rows, other content ids, the same
    size) at the same place, keeps only the text before it; same-size blocks of sentinels would have
    matched through the whole block, reusing A's KV for B."""
    other_ids, other = image(b"image c", A_LEN, 3, A_AT)
    prompt_c = PROMPT[:A_AT] + other_ids + PROMPT[A.stop :]
    session = fresh(image_model, [(0, N)])
    keep = common_prefix_len(session.tokens, prompt_c)
    assert keep == A_AT
    sentinels = [VOCAB + ExpToken.IMAGE] * A_LEN
    assert common_prefix_len(PROMPT[:A_AT] + sentinels, PROMPT[:A_AT] + sentinels + [1]) == A.stop
    session.truncate(keep)
    spans = shifted([other, B], -keep)
    session.prefill(prompt_c[keep:], images=spans)
    alone = Session(image_model, ctx=1024, chunk=16)
    alone.prefill(prompt_c[:keep])
    assert torch.equal(session.logits, alone.prefill(prompt_c[keep:], images=spans))
    assert not close(session.logits, fresh(image_model, [(0, N)]).logits)  # image C is not image A


def test_ids_past_the_vocabulary_outside_a_block_are_refused(image_model):
    session = Session(image_model, ctx=1024, chunk=16)
    session.prefill(TEXT[:5])
    for tokens, spans in (
        (A_IDS, []),  # a block given without its span
        (PROMPT[: A.stop] + [A_IDS[0]], [A]),  # an image id after the block
        (PROMPT[:30] + [VOCAB] + PROMPT[31 : A.stop], [A]),  # one before it, in an earlier pass
    ):
        with pytest.raises(DwarfStarError, match="outside the vocabulary"):
            session.prefill(tokens, images=spans)
        assert session.tokens == TEXT[:5]


def test_snapshot_restore_keeps_the_blocks(image_model):
    session = fresh(image_model, [(0, B_AT)])
    snap = session.snapshot()
    session.prefill(PROMPT[B_AT:], images=[ImageSpan(0, B.rows, B.attend)])
    after = session.logits.clone()
    session.restore(snap)
    assert [s.offset for s in session.images] == [A_AT]
    session.prefill(PROMPT[B_AT:], images=[ImageSpan(0, B.rows, B.attend)])
    assert torch.equal(session.logits, after)
    session.truncate(A.stop + 1)  # replays A from a checkpoint before it
    assert torch.equal(session.logits, fresh(image_model, [(0, A.stop + 1)]).logits)


def test_prefill_batch_takes_spans_per_piece(image_model):
    """Two sessions' pieces with blocks in one batched pass give what each session's own prefill gives;
    a piece whose block starts it may run past the boundary to the block's end, one that a boundary
    would cut inside a later block is refused before anything runs."""
    one, two = Session(image_model, ctx=1024, chunk=16), Session(image_model, ctx=1024, chunk=16)
    one.prefill(PROMPT[:32])
    two.prefill(PROMPT[:A_AT])
    prefill_batch([one, two], [PROMPT[32:A_AT], PROMPT[A_AT : A.stop]], [[], [ImageSpan(0, A.rows, A.attend)]])
    assert two.checkpoints[-1] == A.stop and [s.offset for s in two.images] == [A_AT]
    alone = fresh(image_model, [(0, A.stop)])
    assert close(two.logits, alone.logits)
    with pytest.raises(DwarfStarError, match="crosses the checkpoint boundary"):
        prefill_batch([one], [PROMPT[A_AT - 8 : A.stop]], [[ImageSpan(8, A.rows, A.attend)]])
    assert one.tokens == PROMPT[:A_AT]


def test_wrappers_pass_spans_and_a_route_refuses_them(tiny_open, image_model, want):
    m = ReferenceModel(tiny_open)  # the throttle paces this one's blocks in place
    m.attach_image_biases({il: image_model.ops.layers[il].bias_vl for il in range(TINY.n_layers)})
    session = Session(ThrottledBackend(m, DutyCycle(90)), ctx=1024, chunk=4096)
    assert torch.equal(
        session.prefill(PROMPT, images=[A, B]), Session(image_model, ctx=1024).prefill(PROMPT, images=[A, B])
    )
    route = object.__new__(RouteBackend)
    with pytest.raises(DistError, match="distributed route"):
        route.forward_batch([PROMPT], [image_model.new_state()], images=[[A, B]])


def test_a_restored_state_learns_its_blocks_and_replays_them(image_model):
    """A state read from the disk cache holds a block's ids, not its rows: cutting it back behind the
    block is refused until `adopt` gives it the request's spans; then the replay matches a fresh run."""
    source = fresh(image_model, [(0, N)], chunk=64)
    restored = Session(image_model, ctx=1024, chunk=64)
    restored.state = source.state  # as the pool installs a disk hit: no checkpoints, no spans
    with pytest.raises(DwarfStarError, match="outside the vocabulary|image"):
        restored.truncate(B.stop + 2)
    restored = Session(image_model, ctx=1024, chunk=64)
    restored.state = fresh(image_model, [(0, N)], chunk=64).state
    other_ids, other = image(b"another image", B_LEN, 3, B_AT)  # at B's place, another image: not learnt
    restored.adopt([A, other], PROMPT[:B_AT] + other_ids)
    assert [s.offset for s in restored.images] == [A_AT]
    restored.adopt([A, B], PROMPT)
    restored.truncate(B.stop + 2)
    assert torch.equal(restored.logits, fresh(image_model, [(0, B.stop + 2)], chunk=64).logits)


@pytest.mark.parametrize("length", [A.stop, B.stop, B.stop + 1])
def test_rebuild_recomputes_a_state_that_ends_on_a_block(image_model, length):
    """After a pass that raised midway, the state at `length` is computed again: from before the image
    block that ends there (a cut inside it would be refused), else from before the last token."""
    session = fresh(image_model, [(0, length)], chunk=64)
    session.rebuild(length)
    assert session.tokens == PROMPT[:length]
    assert torch.equal(session.logits, fresh(image_model, [(0, length)], chunk=64).logits)


def test_the_servers_prefill_pieces_never_split_a_block(image_model, want):
    """serving/jobs.py `KV.take`: budgets that end inside a block cut the piece back to its start, or,
    where the block starts the piece, take it whole past the budget; the pieces give the same logits."""
    from types import SimpleNamespace

    from dwarfstar.serving.jobs import KV

    session = Session(image_model, ctx=1024, chunk=4096)
    kv = KV(SimpleNamespace(session=session), list(PROMPT), images=[A, B])
    sizes = []
    while kv.pending:
        piece, blocks = kv.take(7)
        for span in blocks:
            assert 0 <= span.offset and span.stop <= len(piece)
        prefill_batch([session], [piece], [blocks])
        sizes.append(len(piece))
    assert A_LEN in sizes and B_LEN in sizes and max(sizes) == A_LEN  # each block alone, whole
    assert session.tokens == PROMPT and close(session.logits, want)
