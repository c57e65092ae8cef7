"""confkv's OpenAI-compatible server: ``confkv serve``.

``protocol`` (request/response bodies), ``engine_thread`` (the one thread that steps the engine), ``detok``
(incremental detokenisation with stop-string hold-back), ``metrics`` (Prometheus), ``policy_sources`` (watched
policy file, registry reference), ``app`` (FastAPI routes, SSE), ``main`` (uvicorn with a draining SIGTERM),
``settings`` (the flags). Importing this package imports nothing heavy; ``confkv.server.app`` brings in FastAPI.
"""
