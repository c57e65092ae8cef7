"""What the two modules of server tests over one tiny-random ``confkv serve`` share: its limits and flags, the
readers of its ``/metrics``, a multi-turn chat. ``test_server`` covers the routes and what they serve,
``test_server_requests`` how bad requests are refused; each starts its own server with ``api_server()``."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.server_proc import ServerProcess

MODEL = "tiny-random"
MAX_PROMPT = 2000
MAX_TOKENS_LIMIT = 1000
BODY_LIMIT = 65536
#: 128 blocks of 16 tokens: the 32 concurrent requests do not all fit at once, so some wait (none may fail)
POOL = "512KiB"


def api_server() -> ServerProcess:
    """The server both modules drive: small limits, so the tests can cross each one."""
    return ServerProcess(
        "--model", MODEL, "--kv-cache-memory", POOL, "--max-batch-size", "32",
        "--max-prompt-tokens", str(MAX_PROMPT), "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
        "--max-body-bytes", str(BODY_LIMIT),
    )  # fmt: skip


def metrics(server) -> dict[str, dict[tuple, float]]:
    """``{family: {labels: value}}`` of the server's /metrics (parsed by prometheus_client's own parser)."""
    status, text = server.request("GET", "/metrics")
    assert status == 200
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(fam.name, {})[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def value(m: dict, family: str, sample: str | None = None, **labels: str) -> float:
    key = (sample or family, *sorted(labels.items()))
    return m[family][key]


def chat(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": f"Question number {i}: what comes next?"},
        {"role": "assistant", "content": "Let me think."},
        {"role": "user", "content": f"Go on ({i})."},
    ]
