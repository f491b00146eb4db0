"""ServerState: the served model, its engine and settings, built once at start-up and read by routes."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from app.errors import OpenAIError
from app.operations.accounting import Accounting, RequestContext
from app.operations.admission import Admission, load_api_keys
from app.operations.audit import AuditLog
from app.operations.metrics import Metrics
from app.operations.sends import SendBatch
from app.serving.image_prompt import load_images, vision_prompt
from app.serving.images import ImagePart, MediaPolicy
from app.serving.messages import ChatMessage
from app.serving.output_format import OutputFormat, output_format
from app.serving.prompting import chat_prompt_ids, chat_prompt_text
from app.serving.protocol import ServingLimits
from app.serving.reasoning import ReasoningParser, reasoning_parser
from app.serving.responses import ResponseStore
from app.serving.resumable import StreamRegistry
from app.serving.tools import ToolUse
from app.settings import Settings
from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.engine_client import EngineClient, ReplicaSet
from engine.images import ImageInput
from engine.model.causal_lm import PagedCausalLM
from engine.model.loader import LoadedModel, ServedModel, load_model
from engine.sampling.grammar import GrammarError
from engine.sizing import choose_sizes, max_idle_cached_blocks, num_kv_blocks
from engine.types import GrammarSpec, Reasoning

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerState:
    """What the routes read: settings, the served model and the engine (this process's own, or in a
    cluster the replicas behind app/cluster/)."""

    settings: Settings
    loaded: ServedModel
    engine: EngineClient
    model_name: str
    limits: ServingLimits
    # How chat outputs are split into reasoning and answer; None: all of an output is answer.
    reasoning: ReasoningParser | None
    # How a chat output's text becomes content and tool calls, and the grammar that holds it to that.
    output_format: OutputFormat
    streams: StreamRegistry
    responses: ResponseStore
    api_keys: tuple[bytes, ...]
    admission: Admission
    metrics: Metrics
    audit: AuditLog | None
    # What requests' images may be, and the client that fetches those from allowed hosts.
    media: MediaPolicy
    media_client: httpx.AsyncClient
    # A cluster's engine replicas (None: this process's engine), and the tag of this ingress replica that
    # ends the ids of the streams and responses it holds, so any other ingress replica forwards their
    # requests here (app/cluster/forwarding.py).
    replicas: ReplicaSet | None = None
    id_tag: str | None = None

    def new_id(self, prefix: str) -> str:
        """A completion's or a response's id, naming the ingress replica that holds it in a cluster."""
        return f"{prefix}{uuid.uuid4().hex}" + (f".{self.id_tag}" if self.id_tag else "")

    def accounting_for(
        self,
        request: Request,
        endpoint: str,
        streamed: bool,
        num_prompt_tokens: int,
        num_choices: int,
        prompt: Callable[[], object],
    ) -> Callable[[str], Accounting]:
        """What CompletionRenderer.start calls with the completion id to account for this request; `prompt`
        renders the prompt for the audit log, called only when it records content."""
        client = request.client
        context = RequestContext(
            request_id=getattr(request.state, "request_id", "-"),
            client=f"{client.host}:{client.port}" if client else None,
            api_key_id=getattr(request.state, "api_key_id", None),
            endpoint=endpoint,
            streamed=streamed,
        )

        def start(completion_id: str) -> Accounting:
            # The place admit() counted now belongs to the generation's accounting.
            request.state.generation_started = True
            return Accounting(
                self.metrics,
                self.audit,
                context,
                self.model_name,
                completion_id,
                num_prompt_tokens,
                num_choices,
                prompt,
                on_close=self.admission.finished,
            )

        return start

    async def output_grammar(
        self, requested: tuple[GrammarSpec, str] | None, tool_use: ToolUse | None = None
    ) -> GrammarSpec | None:
        """The grammar a request's output must match: its own constraint (and the parameter that set
        it), or with tools the grammar of calls, as the model's output format writes them
        (app/serving/output_format.py). Compiled (or found cached) off the event loop; 400 naming the
        parameter when it does not compile."""
        requested = self.output_format.grammar(requested, tool_use)
        if requested is None:
            return None
        spec, param = requested
        try:
            await run_in_threadpool(self.engine.grammars.compile, spec)
        except GrammarError as exc:
            raise OpenAIError(400, f"{param}: {exc}", param=param) from exc
        return spec

    async def chat_prompt(
        self,
        messages: list[ChatMessage],
        tool_use: ToolUse | None,
        template_kwargs: dict | None,
        parts: list[ImagePart],
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The conversation's prompt ids and images (`parts`: its image parts, named as the request names
        them); a 400 naming the part for an image this server or model does not take."""
        images = await load_images(parts, self.media, self.media_client, self.loaded)
        tokenizer = self.loaded.tokenizer
        multimodal = self.loaded.processor is not None
        if not images:
            return chat_prompt_ids(tokenizer, messages, tool_use, template_kwargs, multimodal), ()
        text = chat_prompt_text(tokenizer, messages, tool_use, template_kwargs=template_kwargs, multimodal=True)
        return await vision_prompt(self.loaded, text, images, parts[0].param)

    def reasoning_for(self, prompt_ids: list[int]) -> Reasoning | None:
        """How the chat output that follows this prompt is split (None: it is all answer)."""
        return self.reasoning.for_prompt(prompt_ids) if self.reasoning is not None else None

    def check_model(self, requested: str | None) -> None:
        if requested not in (None, self.model_name, str(self.loaded.path)):
            raise OpenAIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


async def get_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain `def` dependency on its thread pool, a hop per request for an attribute.
    return request.app.state.sluice


def _draft_model(settings: Settings, loaded: LoadedModel) -> PagedCausalLM | None:
    """The draft for --speculative draft: `self:L` (the model's first L layers) or a folder."""
    if settings.speculative != "draft":
        return None
    if not settings.draft_model:
        raise ValueError("--speculative draft needs --draft-model PATH or self:L")
    if settings.draft_model.startswith("self:"):
        return loaded.model.first_layers(int(settings.draft_model.removeprefix("self:")))
    draft = load_model(
        settings.draft_model,
        settings.cache_dir,
        settings.device,
        settings.dtype,
        batch_invariant=settings.batch_invariant,
        kv_cache_dtype=settings.kv_cache_dtype,
    )
    if draft.tokenizer.get_vocab() != loaded.tokenizer.get_vocab() or draft.model.vocab_size != loaded.model.vocab_size:
        raise ValueError(f"the draft model {settings.draft_model} does not share the served model's tokenizer")
    return draft.model


def _speculative_config(settings: Settings) -> SpeculativeConfig | None:
    if settings.speculative == "off":
        return None
    if settings.ngram_min > settings.ngram_max:
        raise ValueError(f"ngram_min={settings.ngram_min} is above ngram_max={settings.ngram_max}")
    return SpeculativeConfig(
        method=settings.speculative,
        num_tokens=settings.num_speculative_tokens,
        ngram_min=settings.ngram_min,
        ngram_max=settings.ngram_max,
        max_batch_size=settings.speculative_max_batch_size,
    )


def build_engine(settings: Settings) -> tuple[LoadedModel, Engine]:
    """The served model and its engine, sized for this device."""
    loaded = load_model(
        settings.model,
        settings.cache_dir,
        settings.device,
        settings.dtype,
        settings.batch_invariant,
        quantize=None if settings.quantize == "none" else settings.quantize,
        kv_cache_dtype=settings.kv_cache_dtype,
    )
    draft_model = _draft_model(settings, loaded)
    max_model_len = min(settings.max_model_len or loaded.max_position_embeddings, loaded.max_position_embeddings)
    speculative = _speculative_config(settings)
    sizing = choose_sizes(
        loaded.model,
        settings.max_num_seqs,
        settings.max_num_batched_tokens,
        settings.kv_cache_gib,
        settings.gpu_memory_utilization,
        max_model_len,
        rows_per_seq=1 + (speculative.num_tokens if speculative else 0),
        cuda_graphs=not settings.enforce_eager,
    )
    num_blocks = num_kv_blocks(sizing.kv_cache_bytes, settings.block_size, loaded.model, draft_model)
    if num_blocks * settings.block_size < max_model_len:
        raise ValueError(
            f"the KV cache ({sizing.explanation}: {sizing.kv_cache_bytes / 2**30:.2f} GiB) holds "
            f"{num_blocks * settings.block_size} tokens, fewer than max_model_len={max_model_len}; "
            "give it more memory or lower max_model_len"
        )
    idle_blocks = max_idle_cached_blocks(settings.kv_cache_idle_gib, settings.block_size, loaded.model, draft_model)
    config = EngineConfig(
        max_num_seqs=sizing.max_num_seqs,
        max_num_batched_tokens=sizing.max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=settings.block_size,
        num_kv_blocks=num_blocks,
        max_unread_tokens=settings.max_unread_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        speculative=speculative,
        jump_forward=settings.jump_forward,
        pinned_kv_seconds=settings.response_kv_ttl,
        max_idle_cached_blocks=idle_blocks,
        max_pinned_kv_fraction=settings.max_pinned_kv_fraction,
        enforce_eager=settings.enforce_eager,
    )
    logger.info(
        "KV cache: %d blocks of %d tokens in %.2f GiB (%s), idle cached prefixes kept in %s before blocks never "
        "used; max_model_len %d; up to %d streams and %d tokens a step",
        num_blocks,
        settings.block_size,
        sizing.kv_cache_bytes / 2**30,
        sizing.explanation,
        "all of it" if idle_blocks is None else f"{idle_blocks} blocks",
        max_model_len,
        sizing.max_num_seqs,
        sizing.max_num_batched_tokens,
    )
    return loaded, Engine(loaded, config, draft_model)


def build_state(settings: Settings) -> ServerState:
    loaded, engine = build_engine(settings)
    return serve_state(settings, loaded, engine)


def serve_state(
    settings: Settings,
    loaded: ServedModel,
    engine: EngineClient,
    num_replicas: int = 1,
    replicas: ReplicaSet | None = None,
    id_tag: str | None = None,
) -> ServerState:
    """The routes' state over `engine`: with `num_replicas` engines behind it, as many seats are admitted;
    in a cluster's ingress, `replicas` are those engines and `id_tag` this ingress replica's."""
    config = engine.config
    model_name = settings.served_model_name or loaded.name
    return ServerState(
        settings=settings,
        loaded=loaded,
        engine=engine,
        model_name=model_name,
        reasoning=reasoning_parser(settings.reasoning_parser, loaded.tokenizer),
        output_format=output_format(settings.tool_call_parser, loaded.tokenizer),
        limits=ServingLimits(
            max_model_len=config.max_model_len,
            vocab_size=loaded.vocab_size,
            max_num_seqs=config.max_num_seqs,
            stream_interval=settings.stream_interval,
            max_tokens_limit=settings.max_tokens_limit,
            takes_images=loaded.processor is not None,
        ),
        streams=StreamRegistry(settings.resume_window_seconds, SendBatch.build(settings.cache_dir)),
        responses=ResponseStore(settings.response_retention, engine.unpin),
        api_keys=load_api_keys(settings),
        admission=Admission(settings.max_queue, config.max_num_seqs * num_replicas),
        metrics=Metrics(model_name, lambda: engine.stats, replicas),
        audit=AuditLog(settings.audit_log, settings.audit_log_content) if settings.audit_log else None,
        media=MediaPolicy(
            max_images=settings.limit_images_per_prompt,
            max_pixels=settings.max_image_pixels,
            max_bytes=settings.max_image_bytes,
            fetch_timeout=settings.media_fetch_timeout,
            allowed_domains=frozenset(domain.lower() for domain in settings.allowed_media_domains),
        ),
        # Redirects are followed by hand, each checked against the allowed hosts; no proxy from the environment.
        media_client=httpx.AsyncClient(follow_redirects=False, trust_env=False),
        replicas=replicas,
        id_tag=id_tag,
    )
