"""GET /health (readiness), /health/live (liveness), /metrics (Prometheus) and the opt-in fault hook."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from app.operations.admission import authenticate
from app.operations.metrics import CONTENT_TYPE
from app.state import ServerState, get_state

router = APIRouter()
debug_router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(get_state)) -> JSONResponse:
    """Readiness: 200 while the engine serves and the server admits requests; 503 while draining."""
    stats = state.engine.stats
    alive = state.engine.alive
    ready = alive and not state.admission.draining
    body = {
        "status": "draining" if state.admission.draining else "ok" if alive else "unavailable",
        "model": state.model_name,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_paused": stats.num_paused,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "kv_blocks_cached": stats.kv_blocks_cached,
        "kv_blocks_pinned": stats.kv_blocks_pinned,
        "prefix_cache_query_tokens": stats.num_prefix_query_tokens,
        "prefix_cache_hit_tokens": stats.num_prefix_hit_tokens,
        "prefix_cache_hit_rate": round(stats.num_prefix_hit_tokens / max(1, stats.num_prefix_query_tokens), 4),
        "image_cache_queries": stats.num_image_queries,
        "image_cache_hits": stats.num_image_hits,
        "vision_seconds": round(stats.vision_seconds, 3),
    }
    if state.replicas is not None:
        # A cluster's figures above are its serving replicas' sums; each one's own follow.
        replicas = state.replicas.replica_stats()
        body["num_replicas"] = sum(s.alive for s in replicas.values())
        body["replicas"] = {
            replica: {
                "alive": s.alive,
                "num_running": s.num_running,
                "num_waiting": s.num_waiting,
                "kv_blocks_used": s.kv_blocks_used,
                "kv_blocks_total": s.kv_blocks_total,
                "prefix_cache_query_tokens": s.num_prefix_query_tokens,
                "prefix_cache_hit_tokens": s.num_prefix_hit_tokens,
            }
            for replica, s in replicas.items()
        }
        body["routing"] = state.replicas.routing_decisions()
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/health/live")
async def live(state: ServerState = Depends(get_state)) -> JSONResponse:
    """Liveness: 200 while the engine thread runs, draining or not."""
    alive = state.engine.alive
    return JSONResponse({"status": "ok" if alive else "dead"}, status_code=200 if alive else 503)


@router.get(
    "/metrics", response_class=Response, responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
)
async def metrics(request: Request, state: ServerState = Depends(get_state)) -> Response:
    """Prometheus text format; behind the API key only with --protect-metrics."""
    if state.settings.protect_metrics:
        authenticate(request, state.api_keys)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@debug_router.post("/debug/fault")
async def inject_fault(state: ServerState = Depends(get_state)) -> dict:
    state.engine.inject_fault()
    return {"injected": True}
