"""A model whose every layer slides a window hands back the blocks no future query reads
(engine/kv_window.py): a long generation holds a window's worth of blocks, with outputs unchanged; with a
draft model whose every layer slides too, the blocks neither model reads."""

import asyncio
from array import array

import pytest

import engine.kv_window as kv_window_module
from engine.config import SpeculativeConfig
from engine.kv_cache import BlockManager
from engine.kv_window import DraftWindowedBlockManager, WindowedBlockManager, windowed_reach
from engine.tiny import tiny_engine, tiny_hf_model, tiny_loaded
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import collect, hf_greedy_logprobs, make_request, tokens_of

WINDOW, BLOCK, BUDGET = 8, 4, 8
PROMPT = list(range(30, 50))
NEW_TOKENS = 48
# A step holds the window's blocks, the step's new tokens' and a block cut at either end.
MOST_HELD = -(-(WINDOW + BUDGET) // BLOCK) + 2


def _loaded(tokenizer, kernels=True, repetitive=False):
    hf = tiny_hf_model("mistral", repetitive=repetitive, sliding_window=WINDOW)
    return tiny_loaded(tokenizer, "mistral", hf_model=hf, kernels_cache=CACHE_DIR if kernels else None)


def _watched(loaded, **overrides):
    """A tiny engine whose block manager checks its integrity at every step boundary and records the most
    blocks any request held after an allocation."""
    engine = tiny_engine(loaded, block_size=BLOCK, max_num_batched_tokens=BUDGET, **overrides)
    manager, most = engine.block_manager, [0]
    allocate, register = manager.allocate, manager.register

    def watched_allocate(request, num_new_tokens):
        allocate(request, num_new_tokens)
        most[0] = max(most[0], len(request.block_table) - request.num_released_blocks)

    def watched_register(request):
        register(request)
        # Admission registers a request between the waiting queue and the running one.
        requests = engine.scheduler.requests()
        manager.check_integrity(requests if request in requests else [*requests, request])

    manager.allocate, manager.register = watched_allocate, watched_register
    return engine, most


async def _generate(engine, prompts, params):
    engine.start()
    try:
        return [await collect(engine, p, params) for p in prompts]
    finally:
        engine.shutdown()


def _tokens_and_logprobs(chunks):
    return [(t, lp.logprob) for c in chunks for t, lp in zip(c.token_ids, c.logprobs)]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0)


@pytest.mark.parametrize("kernels", [True, False], ids=["invariant-kernels", "torch-kernels"])
async def test_a_long_generation_holds_a_window_of_blocks_with_outputs_unchanged(
    default_tokenizer, monkeypatch, kernels
):
    loaded = _loaded(default_tokenizer, kernels)
    engine, most = _watched(loaded)
    assert isinstance(engine.block_manager, WindowedBlockManager)
    (freed,) = await _generate(engine, [PROMPT], GREEDY)
    assert most[0] <= MOST_HELD
    assert engine.block_manager.num_used == 0
    expected = hf_greedy_logprobs(tiny_hf_model("mistral", sliding_window=WINDOW), PROMPT, NEW_TOKENS)
    assert tokens_of(freed) == [token for token, _ in expected]
    assert [lp for _, lp in _tokens_and_logprobs(freed)] == pytest.approx([lp for _, lp in expected], abs=1e-4)

    monkeypatch.setattr(kv_window_module, "windowed_reach", lambda windows: 0)
    kept, most_kept = _watched(loaded)
    assert type(kept.block_manager) is BlockManager
    (unfreed,) = await _generate(kept, [PROMPT], GREEDY)
    assert most_kept[0] == -(-(len(PROMPT) + NEW_TOKENS - 1) // BLOCK) > MOST_HELD
    assert _tokens_and_logprobs(freed) == _tokens_and_logprobs(unfreed)


async def test_released_blocks_stay_cached_for_the_same_prefix(default_tokenizer):
    loaded = _loaded(default_tokenizer)
    engine, _ = _watched(loaded)
    first, second = await _generate(engine, [PROMPT, PROMPT], GREEDY)
    assert _tokens_and_logprobs(second) == _tokens_and_logprobs(first)
    # The second found every full block of the prompt but the last token's, released as they were.
    assert engine.block_manager.num_prefix_hits == (len(PROMPT) - 1) // BLOCK * BLOCK
    engine.block_manager.check_integrity([])


async def test_a_pool_that_reuses_released_blocks_gives_the_same_outputs(default_tokenizer):
    loaded = _loaded(default_tokenizer)
    (alone,) = await _generate(_watched(loaded)[0], [PROMPT], GREEDY)
    # Too few blocks for the whole sequence: the released ones are handed out again, and the second request
    # finds none of its prefix cached.
    engine, _ = _watched(loaded, num_kv_blocks=MOST_HELD + 1)
    first, second = await _generate(engine, [PROMPT, PROMPT], GREEDY)
    assert _tokens_and_logprobs(first) == _tokens_and_logprobs(second) == _tokens_and_logprobs(alone)


async def test_preempted_requests_recompute_the_same_outputs(default_tokenizer):
    loaded = _loaded(default_tokenizer)
    prompts = [PROMPT, list(range(100, 117)), list(range(200, 226))]
    alone = [(await _generate(_watched(loaded)[0], [p], GREEDY))[0] for p in prompts]
    # Room for one request's window and little more: the youngest are preempted and recompute.
    engine, _ = _watched(loaded, num_kv_blocks=MOST_HELD + 2)
    engine.start()
    try:
        together = await asyncio.gather(*[collect(engine, p, GREEDY) for p in prompts])
    finally:
        engine.shutdown()
    assert engine.scheduler.num_preemptions > 0
    assert [_tokens_and_logprobs(c) for c in together] == [_tokens_and_logprobs(c) for c in alone]


async def test_overlapped_steps_release_the_same_blocks_with_the_same_outputs(default_tokenizer):
    loaded = _loaded(default_tokenizer)
    prompts = [PROMPT, list(range(100, 117))]
    plain = await _generate(_watched(loaded)[0], prompts, GREEDY)
    engine, most = _watched(loaded, overlap_steps=True)
    assert engine.overlap is not None
    overlapped = await _generate(engine, prompts, GREEDY)
    assert [_tokens_and_logprobs(c) for c in overlapped] == [_tokens_and_logprobs(c) for c in plain]
    assert most[0] <= MOST_HELD


async def test_n_choices_share_the_released_prefix(default_tokenizer):
    loaded = _loaded(default_tokenizer)
    (alone,) = await _generate(_watched(loaded)[0], [PROMPT], GREEDY)
    engine, most = _watched(loaded)
    (chunks,) = await _generate(engine, [PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, n=3))
    choices = {}
    for chunk in chunks:
        choices.setdefault(chunk.index, []).extend(chunk.token_ids)
    assert list(choices.values()) == [tokens_of(alone)] * 3
    assert most[0] <= MOST_HELD
    assert engine.block_manager.num_used == 0


async def test_ngram_speculation_stays_lossless(default_tokenizer):
    loaded = _loaded(default_tokenizer, repetitive=True)
    prompts = [[378] * 8 + list(range(100, 112)), list(range(200, 220))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    plain = await _generate(_watched(loaded)[0], prompts, params)
    engine, most = _watched(loaded, speculative=SpeculativeConfig("ngram", num_tokens=4, max_batch_size=16))
    speculated = await _generate(engine, prompts, params)
    assert [tokens_of(c) for c in speculated] == [tokens_of(c) for c in plain]
    assert engine.speculation.num_accepted_tokens > 0
    assert most[0] <= MOST_HELD


# A draft model of its own whose window reaches further back than the target's: what it reads governs.
DRAFT_WINDOW, NUM_PROPOSED = 12, 3
# The draft's next query trails the target's by up to a verification's tokens, and a step's allocation reaches
# the proposals past the new tokens.
MOST_HELD_DRAFTED = -(-(DRAFT_WINDOW + NUM_PROPOSED + 1 + BUDGET + NUM_PROPOSED) // BLOCK) + 2


def _draft(tokenizer, loaded, kind):
    """The draft model: the target's first layer (a self-draft), a model of its own whose every layer slides
    (the target's weights under a wider window: it proposes what the target mostly keeps), or a Llama (global
    layers)."""
    if kind == "self":
        return loaded.model.first_layers(1)
    if kind == "sliding":
        hf = tiny_hf_model("mistral", sliding_window=DRAFT_WINDOW)
    else:
        hf = tiny_hf_model("llama")
    return tiny_loaded(tokenizer, hf_model=hf, kernels_cache=CACHE_DIR).model


@pytest.mark.parametrize("kind", ["self", "sliding"])
async def test_a_sliding_draft_frees_what_neither_model_reads_with_outputs_unchanged(
    default_tokenizer, monkeypatch, kind
):
    """Speculation with a draft model that slides too: the blocks held stay bounded through accepted and
    rolled-back proposals, a prefix found again, and n choices; the outputs are those of the same draft without
    freeing, bit for bit, and the tokens those of no speculation. The draft proposes what it proposes without
    freeing (the same acceptance): it never read a block handed back (the verification would hide that in the
    outputs)."""
    loaded = _loaded(default_tokenizer)
    draft = _draft(default_tokenizer, loaded, kind)
    speculative = SpeculativeConfig("draft", num_tokens=NUM_PROPOSED, max_batch_size=16)
    prompts = [PROMPT, list(range(100, 117)), PROMPT]
    (plain, other_plain, _) = await _generate(_watched(loaded)[0], prompts, GREEDY)
    engine, most = _watched(loaded, draft_model=draft, speculative=speculative)
    assert type(engine.block_manager) is DraftWindowedBlockManager
    freed = await _generate(engine, prompts, GREEDY)
    stats = engine.speculation
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0, "proposals accepted, and some rolled back"
    assert most[0] <= MOST_HELD_DRAFTED < -(-(len(PROMPT) + NEW_TOKENS - 1) // BLOCK)
    assert engine.block_manager.num_prefix_hits >= (len(PROMPT) - 1) // BLOCK * BLOCK
    assert engine.block_manager.num_used == 0
    assert [tokens_of(c) for c in freed] == [tokens_of(plain), tokens_of(other_plain), tokens_of(plain)]

    (choices,) = await _generate(
        _watched(loaded, draft_model=draft, speculative=speculative)[0],
        [PROMPT],
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, n=2),
    )
    assert [t for c in choices if c.index == 1 for t in c.token_ids] == tokens_of(plain)

    monkeypatch.setattr(kv_window_module, "windowed_reach", lambda windows: 0)
    kept, most_kept = _watched(loaded, draft_model=draft, speculative=speculative)
    assert type(kept.block_manager) is BlockManager
    unfreed = await _generate(kept, prompts, GREEDY)
    assert most_kept[0] > MOST_HELD_DRAFTED
    assert [_tokens_and_logprobs(c) for c in freed] == [_tokens_and_logprobs(c) for c in unfreed]
    assert (kept.speculation.num_draft_tokens, kept.speculation.num_accepted_tokens) == (
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )


def test_a_draft_with_a_global_layer_keeps_every_block(default_tokenizer):
    loaded = _loaded(default_tokenizer)
    draft = SpeculativeConfig("draft", num_tokens=NUM_PROPOSED, max_batch_size=16)
    engine = tiny_engine(loaded, draft_model=_draft(default_tokenizer, loaded, "global"), speculative=draft)
    assert type(engine.block_manager) is BlockManager


def test_a_draft_s_lag_holds_the_blocks_it_reads_next():
    manager = DraftWindowedBlockManager(num_blocks=16, block_size=4, window=4, draft_window=6)
    request = make_request(30)
    manager.allocate(request, 30)
    request.num_computed_tokens = 30
    # The draft has not run: it reads every block when it does.
    manager.register(request)
    assert request.num_released_blocks == 0
    # The draft's next query at 21 reads keys 16 .. 21, from block 4; the target alone would release 5 blocks.
    request.num_draft_computed = 21
    manager.register(request)
    assert request.num_released_blocks == 4
    manager.check_integrity([request])
    # Without speculation no draft reads it: the target's reach alone (its next query, at 30, reads from block 6,
    # and the block before it is kept).
    solo = make_request(30, params=SamplingParams(max_tokens=8, temperature=0.0, speculative=False), first_token=90)
    manager.allocate(solo, 30)
    solo.num_computed_tokens = 30
    manager.register(solo)
    assert solo.num_released_blocks == 5
    manager.check_integrity([request, solo])


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss", "llama"])
def test_a_model_with_a_global_layer_frees_nothing(default_tokenizer, model_type):
    loaded = tiny_loaded(default_tokenizer, model_type)
    assert windowed_reach(loaded.model.family.windows) == 0
    assert type(tiny_engine(loaded).block_manager) is BlockManager


def _computed(manager: WindowedBlockManager, num_tokens: int):
    """A request of `num_tokens` prompt tokens, all computed and registered (its passed blocks released)."""
    request = make_request(num_tokens)
    manager.allocate(request, num_tokens)
    request.num_computed_tokens = num_tokens
    manager.register(request)
    return request


def test_released_entries_name_the_first_held_block_through_fork_and_deallocate():
    manager = WindowedBlockManager(num_blocks=12, block_size=4, window=4)
    parent = _computed(manager, 14)
    # The next query (at 14) reads keys 11 .. 14, from block 2: block 1 is kept too (for a pin), block 0 goes.
    assert parent.num_released_blocks == 1
    assert parent.block_table[:1] == array("q", [parent.block_table[1]])
    assert manager.num_used == 3 and manager.num_cached == 3
    child = make_request(14)
    assert manager.fork(parent, child, 14) is not None
    assert child.num_released_blocks == 1 and child.block_table[:3] == parent.block_table[:3]
    manager.check_integrity([parent, child])
    child.block_table[0] = child.block_table[3]
    with pytest.raises(AssertionError, match="released entry"):
        manager.check_integrity([parent, child])
    child.block_table[0] = child.block_table[1]
    read = parent.block_table[2]
    manager.deallocate(parent)
    manager.deallocate(child)
    assert child.num_released_blocks == 0 and manager.num_used == 0
    manager.check_integrity([])
    # The released blocks kept their registration in the pool: a new request adopts the whole prefix, and
    # takes only the block its window still reads (its next query, at 12, reads from block 2), plus one for
    # its last two tokens.
    newcomer = make_request(14)
    cached = manager.cached_prefix(newcomer)
    assert cached == [read] * 3
    assert manager.num_blocks_to_admit(cached, 2) == 2 < BlockManager.num_blocks_to_admit(manager, cached, 2)
    manager.adopt_prefix(newcomer, cached)
    manager.allocate(newcomer, 2)
    assert newcomer.num_released_blocks == 2 and manager.num_used == 2
    manager.check_integrity([newcomer])


def test_a_pin_holds_only_the_blocks_still_held():
    manager = WindowedBlockManager(num_blocks=12, block_size=4, window=4, max_pinned_blocks=6)
    request = _computed(manager, 14)
    assert manager.pin("k", request, deadline=1e18)
    manager.deallocate(request)
    # Blocks 1 and 2: what the next query reads, and the block before it; block 0 went back to the pool.
    assert manager.num_pinned == 2
    manager.check_integrity([])


def test_a_pinned_conversation_finds_its_prefix_after_other_traffic_took_its_first_blocks():
    """A prefix needs only the blocks its next query reads: the pin's, after its released first block went to
    other requests."""
    manager = WindowedBlockManager(num_blocks=8, block_size=4, window=4, max_pinned_blocks=4)
    first = _computed(manager, 14)
    assert manager.pin("k", first, deadline=1e18)
    manager.deallocate(first)
    other = make_request(24, first_token=500)
    manager.allocate(other, 24)
    assert manager.num_free == 0
    manager.deallocate(other)
    follow_up = make_request(20)
    cached = manager.cached_prefix(follow_up)
    assert len(cached) == 3 and manager.num_blocks_to_admit(cached, 8) == 2
    manager.adopt_prefix(follow_up, cached)
    assert follow_up.num_computed_tokens == 12 and follow_up.num_released_blocks == 2
    manager.check_integrity([follow_up])
    # The plain manager's lookup walks from block 0, which other traffic took: nothing found.
    assert BlockManager.cached_prefix(manager, make_request(20)) == []
