"""confkv's OpenAI-compatible server: ``confkv serve``.

``protocol`` (request/response bodies), ``engine_thread`` (the one thread that steps the engine), ``detok``
(incremental detokenisation with stop-string hold-back), ``metrics`` (Prometheus), ``app`` (FastAPI routes, SSE),
``main`` (uvicorn with a draining SIGTERM; the start policy and its follower), ``settings`` (the flags). Importing
this package imports nothing heavy; ``confkv.server.app`` brings in FastAPI.
"""
