"""Health and Prometheus metrics: open without the API key, for load balancers and scrapers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from confkv.server.openapi import HealthStatus, ok
from confkv.server.state import StateDep

router = APIRouter()


@router.get(
    "/health",
    responses={
        **ok(HealthStatus),
        503: {"model": HealthStatus, "description": "draining, or the engine is gone or stuck"},
    },
)
async def health(state: StateDep) -> Response:
    """200 while serving; 503 while draining, or when the engine thread is gone or stuck in a step."""
    et = state.engine_thread
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not et.healthy(state.settings.health_stale_s):
        reason = et.fatal or ("engine thread not running" if not et.alive else "engine step is stuck")
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
    if state.cluster is not None:  # a replica answers for the deployment: how many replicas it has
        return JSONResponse({"status": "ok", **await state.cluster.health()})
    return JSONResponse({"status": "ok"})


@router.get("/metrics", responses=ok(media={"text/plain": {"schema": {"type": "string"}}}))
async def prometheus_metrics(state: StateDep) -> Response:
    if state.cluster is not None:
        return Response(await state.cluster.metrics(), media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
