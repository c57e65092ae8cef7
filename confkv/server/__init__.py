"""confkv's OpenAI-compatible server: ``confkv serve``.

``protocol`` (request/response bodies), ``engine_thread`` (the one thread that steps the engine) with ``channel``
(what passes between it and the HTTP side) and ``inflight`` (the requests in flight and their events), ``detok``
(incremental detokenisation with stop-string hold-back), ``metrics`` (Prometheus), ``app`` (the FastAPI app
assembled from ``routes/``, ``errors``, ``middleware``, ``streaming``, ``openapi`` and ``state``), ``http11``
(uvicorn's h11 protocol with a request-head deadline and the parser's errors in OpenAI's body), ``main`` (uvicorn with
a draining SIGTERM; the start policy and its follower), ``settings`` (the flags). Importing this package imports
nothing heavy; ``confkv.server.app`` brings in FastAPI.
"""
