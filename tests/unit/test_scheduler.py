import random

from engine.encoder_budget import EncoderBudget
from engine.images import ImageInput
from engine.kv_cache import BlockManager
from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.unit.helpers import make_request


def create_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    budget=16,
    eos=frozenset({0}),
    whole_images=False,
    encoder_cache=None,
    encoder_budget=0,
):
    manager = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(
        manager,
        max_num_seqs,
        budget,
        max_model_len=1024,
        eos_token_ids=eos,
        whole_images=whole_images,
        encoder_cache=encoder_cache,
        max_num_encoder_input_tokens=encoder_budget,
    )
    return scheduler, manager


def run_step(scheduler, token=7):
    """Hand the scheduler a fake forward result: every request that reached its end samples `token`."""
    plan = scheduler.schedule()
    sampled = {}
    for request, n in plan.scheduled:
        if request.num_computed_tokens + n == request.num_tokens:
            sampled[request] = [token]
    scheduler.postprocess(plan, sampled)
    return plan


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    scheduler, _ = create_scheduler(budget=16)
    request = make_request(prompt_len=40)
    scheduler.add(request)
    assert [n for _, n in run_step(scheduler).scheduled] == [16]
    assert [n for _, n in run_step(scheduler).scheduled] == [16]
    assert request.num_output_tokens == 0
    assert [n for _, n in run_step(scheduler).scheduled] == [8]
    assert request.num_output_tokens == 1


def test_decodes_are_scheduled_before_a_prefill_chunk():
    scheduler, _ = create_scheduler(budget=16)
    decoding = make_request(prompt_len=4, max_tokens=50)
    scheduler.add(decoding)
    run_step(scheduler)
    long = make_request(prompt_len=100)
    scheduler.add(long)
    for _ in range(5):
        plan = run_step(scheduler)
        assert plan.scheduled[0] == (decoding, 1)
        assert plan.num_tokens == 16


def test_finished_request_leaves_at_once_and_frees_blocks():
    scheduler, manager = create_scheduler()
    request = make_request(prompt_len=5, max_tokens=3)
    scheduler.add(request)
    for _ in range(3):
        run_step(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_output_tokens == 3
    assert not scheduler.has_unfinished
    assert manager.num_used == 0


def test_eos_stops_a_request():
    scheduler, manager = create_scheduler(eos=frozenset({7}))
    request = make_request(prompt_len=3, max_tokens=10)
    scheduler.add(request)
    run_step(scheduler, token=7)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert manager.num_used == 0


def test_admission_respects_max_num_seqs():
    scheduler, _ = create_scheduler(max_num_seqs=2, budget=64)
    requests = [make_request(3, max_tokens=10) for _ in range(3)]
    for r in requests:
        scheduler.add(r)
    run_step(scheduler)
    assert len(scheduler.running) == 2 and list(scheduler.waiting) == [requests[2]]


def test_out_of_blocks_preempts_the_youngest_and_it_recomputes():
    scheduler, manager = create_scheduler(num_blocks=8, block_size=4, budget=64)
    old, young = make_request(8, max_tokens=20), make_request(8, max_tokens=20, first_token=100)
    scheduler.add(old)
    scheduler.add(young)
    run_step(scheduler)
    assert manager.num_used == 4  # two blocks of 4 for each 8-token prompt
    # Both need 28 slots in the end, 7 blocks each: only one fits in 8 at a time.
    while scheduler.num_preemptions == 0:
        run_step(scheduler)
        manager.check_integrity(scheduler.requests())
    assert young.status == RequestStatus.PREEMPTED and not young.block_table
    assert old.status == RequestStatus.RUNNING
    while scheduler.has_unfinished:
        run_step(scheduler)
        manager.check_integrity(scheduler.requests())
    assert old.num_output_tokens == young.num_output_tokens == 20
    assert manager.num_used == 0


def test_random_workload_keeps_block_accounting_exact():
    rng = random.Random(0)
    scheduler, manager = create_scheduler(num_blocks=40, block_size=4, max_num_seqs=6, budget=24)
    finished = 0
    for _ in range(400):
        if rng.random() < 0.3:
            scheduler.add(make_request(rng.randint(1, 30), max_tokens=rng.randint(1, 20)))
        if scheduler.has_unfinished:
            for request in list(scheduler.running):
                if rng.random() < 0.02:
                    scheduler.free(request)
                    request.finish(RequestStatus.FINISHED_CANCELLED)
            before = len(scheduler.requests())
            run_step(scheduler)
            finished += before - len(scheduler.requests())
        manager.check_integrity(scheduler.requests())
        used = len({block_id for r in scheduler.running for block_id in r.block_table})
        assert used == manager.num_used
    assert finished > 20


def test_a_repeated_prompt_prefills_only_what_the_cache_lacks():
    scheduler, manager = create_scheduler(block_size=4, budget=64)
    first = make_request(14, max_tokens=2)
    scheduler.add(first)
    assert [n for _, n in run_step(scheduler).scheduled] == [14]
    second = make_request(14, max_tokens=2)
    scheduler.add(second)
    plan = run_step(scheduler)
    # first decodes one token; second adopts first's 3 full blocks and computes 2 tokens.
    assert [(r is second, n) for r, n in plan.scheduled] == [(False, 1), (True, 2)]
    assert second.num_cached_tokens == 12
    while scheduler.has_unfinished:
        run_step(scheduler)
    assert manager.num_used == 0 and manager.num_cached > 0
    manager.check_integrity([])


def test_admission_counts_the_cached_blocks_it_takes_off_the_free_pool():
    scheduler, manager = create_scheduler(num_blocks=4, block_size=4, budget=64)
    first = make_request(12, max_tokens=1)
    scheduler.add(first)
    while scheduler.has_unfinished:
        run_step(scheduler)
    assert manager.num_free == 4 and manager.num_cached == 3
    # 3 cached blocks adopted off the free pool + 1 fresh one for token 13 = all 4.
    second = make_request(13, max_tokens=3)
    scheduler.add(second)
    run_step(scheduler)
    assert second.num_cached_tokens == 12 and manager.num_free == 0
    while scheduler.has_unfinished:
        run_step(scheduler)
        manager.check_integrity(scheduler.requests())
    assert second.num_output_tokens == 3


def test_requests_are_keys_by_identity():
    """Per-request state of a step is held in dicts keyed by Request: two requests alike are two keys."""
    first, second = make_request(4), make_request(4)
    assert first != second and len({first: 1, second: 2}) == 2
    assert type(first).__hash__ is object.__hash__


def test_a_chunk_never_ends_inside_an_image_block():
    """Where an image's tokens attend to each other both ways, a chunk that would end inside its block ends
    where the block starts, and the next computes the block whole."""
    scheduler, _ = create_scheduler(budget=16, whole_images=True)
    request = make_request(prompt_len=40)
    request.image_blocks = ((10, 22),)
    scheduler.add(request)
    assert [n for _, n in run_step(scheduler).scheduled] == [10]
    assert [n for _, n in run_step(scheduler).scheduled] == [16]
    assert [n for _, n in run_step(scheduler).scheduled] == [14]
    assert request.num_output_tokens == 1


def test_a_prompt_waiting_for_room_for_its_image_block_holds_back_admissions():
    """Decodes leave less budget than an image block needs: its prompt waits, and no request is admitted
    meanwhile (each would take budget it waits for), until the decodes finish and the block fits."""
    scheduler, _ = create_scheduler(budget=16, whole_images=True)
    decoding = [make_request(prompt_len=2, max_tokens=4) for _ in range(4)]
    for request in decoding:
        scheduler.add(request)
    run_step(scheduler)
    image = make_request(prompt_len=30)
    image.image_blocks = ((2, 16),)
    scheduler.add(image)
    assert [n for r, n in run_step(scheduler).scheduled if r is image] == [2]
    later = make_request(prompt_len=3, first_token=50)
    scheduler.add(later)
    for _ in range(2):
        plan = run_step(scheduler)
        assert image not in dict(plan.scheduled) and later.status == RequestStatus.WAITING
    for _ in range(4):
        if image.num_computed_tokens > 2:
            break
        assert later.status == RequestStatus.WAITING
        run_step(scheduler)
    assert image.num_computed_tokens >= 16 and all(r.is_finished for r in decoding)


def with_image(request, content_hash: int, start: int, num_rows: int):
    request.images = (ImageInput(content_hash, ((start, num_rows),), {}),)
    return request


def test_a_step_starts_no_more_new_images_than_its_encoder_budget():
    """Two prompts with a new image of 10 rows each and an encoder budget of 12: the first's image starts, the
    second's chunk ends before its image and the image starts the next step (once the first's is cached)."""
    cache: set[int] = set()
    scheduler, _ = create_scheduler(budget=64, encoder_cache=cache, encoder_budget=12)
    first, second = with_image(make_request(20), 1, 4, 10), with_image(make_request(20), 2, 3, 10)
    scheduler.add(first)
    scheduler.add(second)
    assert [(r, n) for r, n in run_step(scheduler).scheduled] == [(first, 20), (second, 3)]
    cache.add(1)  # what the step's tower call leaves in the encoder cache
    assert [(r, n) for r, n in run_step(scheduler).scheduled] == [(first, 1), (second, 17)]


def test_cached_images_and_an_image_another_chunk_starts_cost_nothing():
    cache = {1}
    scheduler, _ = create_scheduler(budget=64, encoder_cache=cache, encoder_budget=12)
    requests = [with_image(make_request(20), 1, 4, 10), with_image(make_request(20), 2, 4, 10)]
    requests.append(with_image(make_request(20), 2, 6, 10))  # the second's image: encoded once
    for request in requests:
        scheduler.add(request)
    assert [n for _, n in run_step(scheduler).scheduled] == [20, 20, 20]


def test_an_image_larger_than_the_encoder_budget_starts_first_in_its_step():
    """The budget never starves an image: the step's first new image starts whatever its size, and nothing
    new joins it."""
    scheduler, _ = create_scheduler(budget=64, encoder_cache=set(), encoder_budget=8)
    large, small = with_image(make_request(20), 1, 2, 12), with_image(make_request(20), 2, 2, 4)
    scheduler.add(large)
    scheduler.add(small)
    assert [(r, n) for r, n in run_step(scheduler).scheduled] == [(large, 20), (small, 2)]


def test_a_chunk_of_only_the_text_between_an_images_runs_costs_nothing():
    """An image whose tiles are runs with text between them (Idefics3's) is reached by a chunk only where the
    chunk holds one of its runs: the text between them starts no tower work, and leaves the room to others."""
    budget = EncoderBudget(set(), num_rows=10)
    tiled = make_request(20)
    tiled.images = (ImageInput(1, ((2, 4), (12, 4)), {}),)
    assert budget.fit(tiled, 6, 6) == 6
    budget.charge(tiled, 6, 6)
    assert (budget.num_rows, budget.started) == (10, set())
    other = with_image(make_request(20), 2, 0, 6)
    assert budget.fit(other, 0, 10) == 10


def test_a_running_chunk_waits_for_encoder_room_and_text_models_never_ask():
    """A running prompt whose next chunk starts at a new image that does not fit beside an earlier prompt's
    computes nothing that step; without an encoder cache (a text model) images are not looked at."""
    cache: set[int] = set()
    scheduler, _ = create_scheduler(budget=24, encoder_cache=cache, encoder_budget=10)
    first, second = make_request(40), with_image(make_request(40), 2, 2, 8)
    first.images = (ImageInput(1, ((2, 8),), {}), ImageInput(3, ((22, 8),), {}))
    scheduler.add(first)
    scheduler.add(second)
    # The first's second image does not fit beside its first: it ends before it; the second stops at its own.
    assert [(r, n) for r, n in run_step(scheduler).scheduled] == [(first, 22), (second, 2)]
    cache.add(1)
    assert [(r, n) for r, n in run_step(scheduler).scheduled] == [(first, 18)]
    cache.add(3)
    assert [(r, n) for r, n in run_step(scheduler).scheduled] == [(first, 1), (second, 23)]
    text, _ = create_scheduler(budget=128)
    requests = [with_image(make_request(50), content, 4, 40) for content in (1, 2)]
    for request in requests:
        text.add(request)
    assert [n for _, n in run_step(text).scheduled] == [50, 50]
