import asyncio
import gc

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from app.server import _start_engine_thread
from app.settings import Settings
from app.state import build_state
from engine.model.host_memory import COLLECTOR_THRESHOLDS
from engine.tiny import tiny_hf_model
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import collect, tokens_of


@pytest.fixture
def folder(tmp_path, default_tokenizer):
    path = tmp_path / "tiny"
    tiny_hf_model("llama", repetitive=True).save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


def settings(folder, **extra) -> Settings:
    return Settings(model=str(folder), cache_dir=CACHE_DIR, dtype="float32", kv_cache_gib=0.01, **extra)


async def test_a_draft_folder_serves_with_output_unchanged(folder):
    plain = build_state(settings(folder))
    drafted = build_state(settings(folder, speculative="draft", draft_model=str(folder)))
    for state in (plain, drafted):
        state.engine.start()
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0)
        want, got = await asyncio.gather(
            collect(plain.engine, [378] * 6, params), collect(drafted.engine, [378] * 6, params)
        )
        assert tokens_of(got) == tokens_of(want)
        # The draft is the model itself: every proposal is accepted.
        assert got[-1].timings.accepted_tokens == got[-1].timings.draft_tokens > 0
    finally:
        plain.engine.shutdown()
        drafted.engine.shutdown()


def test_self_draft_takes_the_first_layers(folder):
    state = build_state(settings(folder, speculative="draft", draft_model="self:1"))
    assert state.engine.speculation.proposer.runner.model.num_layers == 1
    with pytest.raises(ValueError, match="self-draft"):
        build_state(settings(folder, speculative="draft", draft_model="self:2"))
    with pytest.raises(ValueError, match="--draft-model"):
        build_state(settings(folder, speculative="draft"))


def test_a_draft_with_another_vocabulary_is_refused(folder, tmp_path, default_tokenizer):
    other = tmp_path / "other"
    LlamaForCausalLM(
        LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(other)
    default_tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="tokenizer"):
        build_state(settings(folder, speculative="draft", draft_model=str(other)))


async def test_start_up_takes_what_it_built_out_of_the_collectors_passes(folder):
    thresholds = gc.get_threshold()
    state = await _start_engine_thread(settings(folder))
    try:
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == COLLECTOR_THRESHOLDS
        # Full collections walk only what was made since: not the engine, its model or the tokenizer.
        tracked = {id(obj) for obj in gc.get_objects()}
        assert id(state.engine) not in tracked
        assert id(state.engine.runner.model) not in tracked
    finally:
        state.engine.shutdown()
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_a_plain_cpu_start_takes_the_cpu_defaults_and_a_small_cache_is_refused(folder):
    state = build_state(Settings(model=str(folder), cache_dir=CACHE_DIR, dtype="float32"))
    config = state.engine.config
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 256)
    assert state.limits.max_num_seqs == 64
    # 2 GiB of the tiny model's K/V (2 layers, 2 KV heads of 16 dimensions, float32) in blocks of 16.
    assert config.num_kv_blocks == 2 * 2**30 // (2 * 2 * 2 * 16 * 4 * 16)
    with pytest.raises(ValueError, match="holds 16 tokens, fewer than max_model_len"):
        build_state(Settings(model=str(folder), cache_dir=CACHE_DIR, dtype="float32", kv_cache_gib=8192 / 2**30))
