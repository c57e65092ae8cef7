"""``confkv serve``'s flags and the settings object the server runs with.

Kept free of heavy imports (no FastAPI, no torch) so that ``confkv --help`` and argument errors stay instant; the
server itself is imported only once the flags are known to be good.
"""

from __future__ import annotations

import argparse
import os

from pydantic import BaseModel, ConfigDict, Field

#: vLLM's defaults where they exist; the loopback host keeps a fresh server off the network until asked.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


class ServerSettings(BaseModel):
    """What the HTTP side needs to know; the engine's own settings live in ``EngineConfig`` and ``CachePolicy``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = DEFAULT_HOST
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    served_model_name: str = Field("confkv", min_length=1)
    api_key: str | None = Field(None, description="bearer token required on /v1/* when set")
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="request bodies above this get 413")
    max_prompt_tokens: int | None = Field(None, ge=1, description="prompts above this get 400 (default: context)")
    max_tokens_limit: int | None = Field(None, ge=1, description="max_tokens above this gets 400 (default: context)")
    shutdown_grace_s: float = Field(30.0, ge=0, description="SIGTERM: how long running requests may finish")
    policy_poll_s: float = Field(2.0, gt=0, description="how often --policy-file / the registry are checked")
    health_stale_s: float = Field(60.0, gt=0, description="a step running longer than this makes /health 503")
    header_timeout_s: float = Field(10.0, gt=0, description="a request head not complete by then gets 408")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body not complete by then gets 408")
    allowed_policy_dirs: tuple[str, ...] = Field(
        (), description="folders a learned policy may be loaded from over the API (none: only the served one)"
    )
    # Sessions (``confkv.sessions.tiers``). ``session_store`` None means the default folder under the cache
    # (``confkv.sessions.store.default_url``), resolved at start-up; "none" keeps sessions in memory only.
    session_store: str | None = Field(None, min_length=1, description="object store URL for session records")
    session_idle_s: float = Field(60.0, ge=0, description="a session unused this long leaves the device")
    session_offload_s: float = Field(600.0, ge=0, description="a session unused this long goes to the store")
    session_ttl_s: float = Field(24 * 3600.0, gt=0, description="a session unused this long is deleted")
    session_store_timeout_s: float = Field(5.0, gt=0, description="how long the store may stay silent per call")
    session_flush_s: float = Field(60.0, ge=0, description="SIGTERM: how long writing sessions to the store may take")
    session_write_through: bool = Field(False, description="write each finished turn to the store (replicas)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The serve-only flags. ``confkv.cli`` adds the ones every command shares: the model's (--model, --device,
    --dtype, --kv-cache-memory, --kv-cache-dtype, --cache-dir), --max-num-batched-tokens, and the policy's (--policy,
    alias --cache-policy, which also takes a registry reference ``registry://NAME@ALIAS``; --policy-file; --set).
    vLLM's spelling ``--max-num-seqs`` is accepted for ``--max-batch-size``.
    """
    p.add_argument("--registry-url", default=None, help="policy registry database URL (default: the store's)")
    p.add_argument(
        "--max-batch-size", "--max-num-seqs", dest="max_batch_size", type=int, default=32, help="sequences per step"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default {DEFAULT_HOST}: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--api-key",
        default=os.environ.get("CONFKV_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $CONFKV_API_KEY; unset = open)",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body (default 4 MiB)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: the context)")
    p.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens (default: the context)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds SIGTERM lets running requests finish")
    p.add_argument("--policy-poll-interval", type=float, default=2.0, help="seconds between policy source checks")
    p.add_argument(
        "--header-timeout-s",
        metavar="S",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's head (line and headers); then 408 and the connection closes",
    )
    p.add_argument(
        "--body-timeout-s",
        metavar="S",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's body once its head is in; then 408",
    )
    p.add_argument(
        "--allowed-policy-dir",
        metavar="DIR",
        action="append",
        default=[],
        dest="allowed_policy_dirs",
        help="a folder (and those under it) that PUT /v1/cache_policy may load a learned policy from; repeatable "
        "(default: none, so the API loads no learned policy folder but the one served)",
    )
    p.add_argument(
        "--session-store",
        default=None,
        metavar="URL",
        help="where idle sessions' KV records go: a folder, file://, s3://BUCKET/PREFIX (endpoint and credentials "
        "from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION), memory://, or none "
        "(default: CACHE_DIR/sessions)",
    )
    p.add_argument(
        "--session-idle-s",
        metavar="S",
        type=float,
        default=60.0,
        help="unused seconds before a session leaves the device",
    )
    p.add_argument(
        "--session-offload-s",
        metavar="S",
        type=float,
        default=600.0,
        help="unused seconds before a session goes to the store",
    )
    p.add_argument(
        "--session-ttl-s",
        metavar="S",
        type=float,
        default=24 * 3600.0,
        help="unused seconds before a session is deleted",
    )
    p.add_argument(
        "--session-store-timeout-s",
        metavar="S",
        type=float,
        default=5.0,
        help="seconds a store call may stay silent (then: recompute)",
    )
    p.add_argument(
        "--session-flush-timeout-s",
        metavar="S",
        type=float,
        default=60.0,
        help="SIGTERM: seconds to write the sessions held in memory to the store before exiting",
    )
    p.add_argument(
        "--session-write-through",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also write each finished turn's session to the store, so another server on the same store resumes it "
        "if this one dies (default: on with --replicas, off without; --no-session-write-through: only on eviction "
        "and drain)",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Flags to settings; a bad value becomes one ``ConfkvError`` naming the flag's field."""
    from pydantic import ValidationError

    from confkv.config import format_validation_error
    from confkv.errors import ConfkvError

    try:
        return ServerSettings(
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name or args.model,
            api_key=args.api_key or None,
            max_body_bytes=args.max_body_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens_limit=args.max_tokens_limit,
            shutdown_grace_s=args.shutdown_grace,
            policy_poll_s=args.policy_poll_interval,
            header_timeout_s=args.header_timeout_s,
            body_timeout_s=args.body_timeout_s,
            allowed_policy_dirs=tuple(args.allowed_policy_dirs or ()),
            session_store=args.session_store,
            session_idle_s=args.session_idle_s,
            session_offload_s=args.session_offload_s,
            session_ttl_s=args.session_ttl_s,
            session_store_timeout_s=args.session_store_timeout_s,
            session_flush_s=args.session_flush_timeout_s,
            session_write_through=bool(getattr(args, "session_write_through", False)),
        )
    except ValidationError as err:
        raise ConfkvError(format_validation_error(err, "server setting")) from None
