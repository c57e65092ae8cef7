"""``confkv serve``: build the engine, its thread, the app, and run uvicorn with a draining shutdown.

SIGTERM (or a first Ctrl-C) does not stop uvicorn at once: the server first stops admitting (``/health`` and new
requests answer 503), lets the running requests finish for up to ``--shutdown-grace`` seconds, aborts what is left
(their streams end with ``finish_reason: "abort"``), and only then lets uvicorn close its connections; the process
exits 0. A second signal skips the wait. uvicorn's own handler is replaced because it re-raises the signal after a
graceful stop, which would end the process with status 143 instead of 0. Once the requests are gone, the engine
thread writes every session it still holds to the session store (``--session-flush-timeout-s`` at most) and closes
the engine, so a server restarted on the same store resumes them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from confkv.config import CachePolicy, make_engine_config
from confkv.errors import ConfkvError
from confkv.policy_source import PolicyChoice, PolicyFollower, choose_policy
from confkv.server.app import create_app
from confkv.server.engine_thread import EngineThread, idle_wake_s
from confkv.server.http11 import protocol_for
from confkv.server.metrics import ServerMetrics
from confkv.server.settings import ServerSettings, settings_from_args
from confkv.server.state import ServerState

if TYPE_CHECKING:
    from confkv.engine.engine import LLMEngine
    from confkv.sessions.state import SessionOptions

log = logging.getLogger("confkv.server")


class DrainingServer(uvicorn.Server):
    """uvicorn with confkv's SIGTERM: drain, then exit 0 (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                host = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
                # one parseable line: tests and scripts that asked for port 0 read the real port from it
                print(f"confkv: listening on http://{host}:{port}", file=sys.stderr, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self.state.draining
            if self.state.draining:
                self.state.engine_thread.abort_all()
            return
        log.info("signal %s: draining (grace %.0fs)", signal.Signals(sig).name, self.state.settings.shutdown_grace_s)
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        et = self.state.engine_thread
        deadline = time.monotonic() + self.state.settings.shutdown_grace_s
        while et.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if et.num_in_flight:
            log.warning("grace period over: aborting %d running requests", et.num_in_flight)
            et.abort_all()
            end = time.monotonic() + 5
            while et.num_in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let the last SSE chunks reach their clients
        self.should_exit = True


def build_policy(args: argparse.Namespace) -> PolicyChoice:
    """The start policy, what to call it, and what to follow (``--policy-file``, or a registry reference)."""
    return choose_policy(args.policy, args.policy_file, args.overrides or None, model=args.model,
                         cache_dir=args.cache_dir, registry_url=args.registry_url, source="cli")  # fmt: skip


def apply_and_wait(engine_thread: EngineThread, policy: CachePolicy, info: dict[str, str | None]) -> None:
    """Swap through the engine thread's inbox and wait for the engine's verdict; a refusal is counted and logged."""
    source = info["source"] or ""
    try:
        engine_thread.set_policy(policy, source=source, version=info["version"], name=info["name"]).result(timeout=120)
    except ConfkvError as err:
        engine_thread.refuse_policy(source, str(err))


def follow_policy(choice: PolicyChoice, engine_thread: EngineThread, *, interval_s: float,
                  registry_url: str | None) -> PolicyFollower:  # fmt: skip
    """A started follower of the start policy's file or registry alias that swaps each new version in."""
    return PolicyFollower(choice, lambda p, info: apply_and_wait(engine_thread, p, info), engine_thread.refuse_policy,
                          interval_s=interval_s, registry_url=registry_url).start()  # fmt: skip


def session_options(settings: ServerSettings, cache_dir: str | None) -> SessionOptions:
    """The engine's session options from the flags: ``--session-store`` absent is the folder under the cache
    (``default_url``), ``none`` no store (sessions live in memory only and are lost at exit). S3 endpoint,
    credentials and region come from the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), read by
    s3fs/botocore, so no secret ever appears on a command line."""
    from confkv.sessions.state import SessionOptions
    from confkv.sessions.store import default_url

    url = settings.session_store
    if url is None:
        url = default_url(cache_dir)
    elif url.strip().lower() == "none":
        url = None
    return SessionOptions(
        store_url=url,
        idle_s=settings.session_idle_s,
        offload_s=settings.session_offload_s,
        ttl_s=settings.session_ttl_s,
        timeout_s=settings.session_store_timeout_s,
        write_through=settings.session_write_through,
    )


def build_state(engine: LLMEngine, settings: ServerSettings) -> ServerState:
    """Engine thread + metrics + shared state over a loaded engine (the thread is started by the app's lifespan)."""
    et = EngineThread(
        engine,
        max_prompt_tokens=settings.max_prompt_tokens,
        max_tokens_limit=settings.max_tokens_limit,
        session_flush_s=settings.session_flush_s,
        wake_s=idle_wake_s(settings.session_idle_s, settings.session_offload_s),
    )
    state: ServerState
    metrics = ServerMetrics(
        snapshot=lambda: et.stats_snapshot,
        policy_info=lambda: et.policy_snapshot[1],
        health=lambda: (state.healthy(), state.draining),
        device=engine.device,
    )
    et.metrics = metrics
    state = ServerState(et, settings, metrics)
    return state


def load_engine(args: argparse.Namespace, settings: ServerSettings) -> tuple[LLMEngine, PolicyChoice]:
    """The engine ``confkv serve`` runs (one per replica under ``--replicas``) and the policy it started with."""
    from confkv.engine.engine import LLMEngine

    choice = build_policy(args)
    info = choice.info
    config = make_engine_config(
        {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "kv_cache_memory": args.kv_cache_memory,
            "kv_cache_dtype": args.kv_cache_dtype,
            "host_kv_dtype": args.host_kv_dtype,
            "kv_float_window": args.kv_float_window,
            "max_batch_size": args.max_batch_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len,
            "seed": args.seed,
            "cache_dir": args.cache_dir,
            "admission": args.admission,
        }
    )
    logging.getLogger("confkv").setLevel(args.log_level.upper())
    sessions = session_options(settings, args.cache_dir)
    t0 = time.perf_counter()
    engine = LLMEngine(config, choice.policy, policy_info=info, sessions=sessions)
    print(
        f"confkv: model {args.model} loaded in {time.perf_counter() - t0:.1f}s on {engine.device}; "
        f"policy {info['name']} (version {info['version']}, from {info['source']}); "
        f"KV pool {engine.pool.total_bytes / 2**20:.1f} MiB ({engine.pool.num_tokens} tokens at "
        f"kv_cache_dtype {engine.pool.kv_cache_dtype}"
        f"{f', float window {engine.pool.window.tokens}' if engine.pool.window is not None else ''}); "
        f"session store {sessions.store_url or 'none (memory only)'}"
        f"{' (write-through)' if sessions.write_through and sessions.store_url else ''}",
        file=sys.stderr,
        flush=True,
    )
    return engine, choice


def make_lifespan(
    state: ServerState, choice: PolicyChoice, registry_url: str | None, on_start: Any = None
) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """The app's lifespan: start the engine thread (and the policy follower, and ``on_start``'s async context, a
    replica's link to its deployment), and on the way out stop them; stopping the thread writes the sessions to the
    store."""

    @asynccontextmanager
    async def lifespan(_: Any):  # type: ignore[no-untyped-def]
        state.engine_thread.start()
        watchers: list[Any] = []
        if choice.followable:
            watchers.append(follow_policy(choice, state.engine_thread, interval_s=state.settings.policy_poll_s,
                                          registry_url=registry_url))  # fmt: skip
        try:
            if on_start is None:
                yield
            else:
                async with on_start():
                    yield
        finally:
            for w in watchers:
                w.stop()
            await asyncio.get_running_loop().run_in_executor(None, state.engine_thread.stop)

    return lifespan


def serve(args: argparse.Namespace) -> int:
    """Run ``confkv serve`` until SIGTERM / Ctrl-C; returns the exit status."""
    settings = settings_from_args(args)
    engine, choice = load_engine(args, settings)
    state = build_state(engine, settings)
    lifespan = make_lifespan(state, choice, args.registry_url)

    app = create_app(state, lifespan=lifespan)
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "listening on %s: reachable from the network%s",
            settings.host,
            "" if settings.api_key else ", with no API key",
        )
    uv_config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        access_log=getattr(args, "access_log", False),
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
        http=protocol_for(state),  # h11 with a deadline on request heads and the parser's errors in OpenAI's body
    )
    server = DrainingServer(uv_config, state)
    server.run()
    if not server.started:
        raise ConfkvError(f"could not listen on {settings.host}:{settings.port} (is the port in use?)")
    return 0
