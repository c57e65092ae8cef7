"""Time to first token of a chat's third turn with about 2,000 tokens of history: resumed from a session in object
storage (a local folder, an S3 server) against recomputing the whole conversation (no session).

    python benchmarks/session_ttft.py --model smollm2-135m --repeats 3 --out session_ttft.json
    python benchmarks/session_ttft.py --model tiny-random --doc-tokens 1800 --repeats 1     # a quick check
    python benchmarks/session_ttft.py --kv-cache-dtype int8 --stores local,s3 --repeats 2   # kv-int8 records

For each store the script starts ``confkv serve`` (``--policy full`` by default, so both paths must give the same
text) on loopback with ``--session-idle-s 0 --session-offload-s 0``: a finished turn's session leaves the device at
the engine's next idle wake-up and is written to the store. Per repeat, a new session:

1. turn 1: the user pastes ``--doc-tokens`` tokens of held-out documentation (``confkv.bench.corpus``, a different
   passage per repeat) and asks what it is about; turn 2: a short question. Before each next turn the script waits
   until the session has left memory and its new record is in the store (the record object's size changes: records
   are written atomically, so a changed object is a whole new one);
2. turn 3, timed: a short question with the whole conversation, streamed; TTFT is the time from sending the request
   to the first chunk with content. Once with ``session_id`` (the record is read and checked, its blocks come back,
   only the new turn is computed) and once without (the whole conversation is read as a prompt), in alternating
   order. ``cached_tokens`` comes from ``usage.prompt_tokens_details``; the restore time from the server's
   ``confkv:session_restore_seconds`` histogram.

Stores (``--stores``): ``local`` (a temporary folder), ``s3`` (moto's standalone S3 server on a free loopback port,
started in this process, unless ``--s3-url s3://BUCKET/PREFIX`` names a real one, reached with the AWS_* environment),
and ``device`` (no store, sessions kept on the device: the best case, for scale). Moto is a functional S3, not a
fast one: its numbers bound a real service's from above on loopback, they do not predict it.

Everything is bounded: ``--start-timeout`` per server, ``--request-timeout`` per request, ``--time-limit`` for the
whole run (remaining repeats are skipped, and say so). Prints a table and one JSON object (``--out`` writes it too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from confkv.bench.corpus import split_passage  # noqa: E402
from confkv.server.launcher import ServerProcess, free_port, serve_command  # noqa: E402
from confkv.sessions.store import RECORD_SUFFIX, SessionStore  # noqa: E402

TURN1 = "Here is part of the Python documentation:\n\n{doc}\n\nIn one sentence, what is this part about?"
TURN2 = "Name one term it defines."
TURN3 = "Give a short example that uses it."
#: AWS settings that could point the server at a real account; dropped from its environment when moto is the store
_MOTO_DROPS = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE")


# ------------------------------------------------------------------------------------------------------ servers
def start_server(args: argparse.Namespace, store: str, env: dict[str, str]) -> ServerProcess:
    """``confkv serve`` on a free loopback port for one store (``env``: moto's AWS_* settings, or empty)."""
    flags = ["--model", args.model, "--policy", args.policy, "--kv-cache-memory", args.kv_cache_memory,
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--session-store", store,
             "--log-level", "warning"]  # fmt: skip
    if store != "none":
        flags += ["--session-idle-s", "0", "--session-offload-s", "0"]
    if args.device:
        flags += ["--device", args.device]
    flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.host_kv_dtype:
        flags += ["--host-kv-dtype", args.host_kv_dtype]
    if args.cache_dir:
        flags += ["--cache-dir", args.cache_dir]
    drops = dict.fromkeys(_MOTO_DROPS) if env else {}  # moto: no real profile
    return ServerProcess(  # stop: SIGTERM, on which it writes its sessions to the store first
        serve_command(*flags), env={**drops, **env}, cwd=REPO, start_timeout=args.start_timeout, stop_timeout=120
    )


def metrics(server: ServerProcess) -> dict[tuple[str, ...], float]:
    """``{(sample name, *label values): value}`` of the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = server.request("GET", "/metrics")
    return {(s.name, *s.labels.values()): s.value for f in text_string_to_metric_families(text) for s in f.samples}


@contextlib.contextmanager
def moto_s3() -> Iterator[tuple[str, dict[str, str]]]:
    """moto's S3 server on loopback with a fresh bucket: (store URL, the server's AWS_* environment)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per S3 request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull}  # fmt: skip
    bucket = f"sessions-{uuid.uuid4().hex[:12]}"
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=bucket)  # fmt: skip
        yield f"s3://{bucket}/sessions", env
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------- prompts
def token_counter(model: str, cache_dir: str | None) -> Callable[[str], int] | None:
    """The model's tokenizer as a counter (the server has converted smollm2 by now), or None when unknown."""
    from confkv.model_loader import TINY_RANDOM, model_folder, tiny_random_tokenizer

    try:
        if model == TINY_RANDOM:
            tok = tiny_random_tokenizer()
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_folder(model, cache_dir), local_files_only=True)
    except Exception:
        return None
    return lambda text: len(tok(text)["input_ids"])


def document(tokens: int, seed: int, count: Callable[[str], int] | None) -> str:
    """A held-out passage of about ``tokens`` tokens (4 characters a token when the tokenizer is unknown)."""
    chars = tokens * 4
    if count is None:
        return split_passage(chars, seed, "heldout")
    for _ in range(6):  # a few secant steps on characters per token
        text = split_passage(chars, seed, "heldout")
        n = count(text)
        if abs(n - tokens) <= tokens // 50:
            break
        chars = max(64, int(chars * tokens / max(n, 1)))
    return text


# ------------------------------------------------------------------------------------------------------ turns
def stream_turn(
    client: Any, model: str, messages: list[dict[str, str]], session: str | None, max_tokens: int
) -> dict[str, Any]:
    """One greedy streamed turn: its text, TTFT (first chunk with content) and usage."""
    extra = {"session_id": session} if session else {}
    t0 = time.perf_counter()
    ttft = None
    parts = []
    usage = None
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    return {
        "text": "".join(parts),
        "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": details.cached_tokens if details is not None else 0,
    }


def wait_stored(
    server: ServerProcess, store: SessionStore | None, session: str, old_size: int | None, timeout: float
) -> int:
    """Until the session has left memory and a new record of it (another size than ``old_size``) is in the store."""
    if store is None:
        return 0
    path = f"{store.root}/{session}{RECORD_SUFFIX}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(server)
        if m[("confkv:sessions", "device")] + m[("confkv:sessions", "host")] == 0:
            with contextlib.suppress(FileNotFoundError):
                size = int(store.fs.info(path)["size"])
                if size != old_size:
                    return size
        time.sleep(0.05)
    raise TimeoutError(f"session {session} did not reach the store within {timeout:.0f}s")


def restore_seconds(server: ServerProcess) -> tuple[float, float]:
    m = metrics(server)
    return m[("confkv:session_restore_seconds_sum",)], m[("confkv:session_restore_seconds_count",)]


def run_store(args: argparse.Namespace, kind: str, deadline: float, out: dict[str, Any]) -> None:
    """Start the server for one store, run the repeats, stop it; results go into ``out[kind]``."""
    import openai

    rows: list[dict[str, Any]] = []
    out[kind] = {"rows": rows}
    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        if kind == "device":
            url = "none"
        elif kind == "local":
            folder = Path(tempfile.mkdtemp(prefix="confkv-session-ttft-"))
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
            url = str(folder)
        elif args.s3_url:
            url = args.s3_url
        else:
            url, env = stack.enter_context(moto_s3())
        out[kind]["store"] = url
        with contextlib.ExitStack() as envs:  # this process's own view of the store uses the same environment
            for key, value in env.items():
                envs.enter_context(_setenv(key, value))
            for key in _MOTO_DROPS if env else ():
                envs.enter_context(_setenv(key, None))
            store = None if url == "none" else SessionStore(url, timeout_s=args.request_timeout)
            print(f"# {kind}: starting confkv serve --model {args.model} --session-store {url}", file=sys.stderr)
            server = start_server(args, url, env)
            stack.callback(server.stop)
            client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                   timeout=args.request_timeout)  # fmt: skip
            count = token_counter(args.model, args.cache_dir)
            stream_turn(client, args.model, [{"role": "user", "content": "Hello!"}], None, 4)  # warm-up
            for r in range(args.repeats):
                if time.monotonic() > deadline:
                    out[kind]["skipped_repeats"] = args.repeats - r
                    print(f"# {kind}: time limit reached, {args.repeats - r} repeats skipped", file=sys.stderr)
                    break
                rows.append(one_repeat(args, client, server, store, count, kind, r))
                print(f"# {kind} repeat {r}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _setenv(key: str, value: str | None) -> Iterator[None]:
    """``os.environ[key] = value`` (None: unset) for the block, then as it was."""
    old = os.environ.get(key)
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def one_repeat(
    args: argparse.Namespace,
    client: Any,
    server: ServerProcess,
    store: SessionStore | None,
    count: Callable[[str], int] | None,
    kind: str,
    r: int,
) -> dict[str, Any]:
    session = f"ttft-{kind}-{r}-{uuid.uuid4().hex[:8]}"
    doc = document(args.doc_tokens, seed=1000 + r, count=count)
    messages: list[dict[str, str]] = []
    size = None
    for text in (TURN1.format(doc=doc), TURN2):
        messages.append({"role": "user", "content": text})
        res = stream_turn(client, args.model, messages, session, args.max_tokens)
        messages.append({"role": "assistant", "content": res["text"]})
        size = wait_stored(server, store, session, size, args.request_timeout)
    messages.append({"role": "user", "content": TURN3})
    row: dict[str, Any] = {"repeat": r, "record_bytes": size}
    order = ("session", "recompute") if r % 2 == 0 else ("recompute", "session")
    for how in order:
        before = restore_seconds(server)
        res = stream_turn(client, args.model, messages, session if how == "session" else None, args.max_tokens)
        after = restore_seconds(server)
        row[how] = {k: res[k] for k in ("ttft_s", "prompt_tokens", "cached_tokens")}
        row[how]["text"] = res["text"]
        if how == "session":
            row[how]["restore_s"] = after[0] - before[0] if after[1] > before[1] else 0.0
    row["same_text"] = row["session"].pop("text") == row["recompute"].pop("text")
    with contextlib.suppress(OSError):
        server.request("DELETE", f"/v1/sessions/{session}")  # its KV is no use to the next repeat
    return row


# ---------------------------------------------------------------------------------------------------- report
def summary(out: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per store (the session path) and one for recomputation over every server's runs."""
    lines = []
    recompute = [row["recompute"] for kind in out.values() for row in kind["rows"]]
    for kind, res in out.items():
        rows = res["rows"]
        if not rows:
            continue
        ttfts = [row["session"]["ttft_s"] for row in rows]
        lines.append({
            "path": f"session ({kind})",
            "n": len(rows),
            "ttft_median_s": statistics.median(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts),
            "restore_mean_s": statistics.fmean(row["session"]["restore_s"] for row in rows),
            "prompt_tokens": statistics.fmean(row["session"]["prompt_tokens"] for row in rows),
            "cached_tokens": statistics.fmean(row["session"]["cached_tokens"] for row in rows),
            "record_mib": statistics.fmean((row["record_bytes"] or 0) / 2**20 for row in rows),
            "same_text": all(row["same_text"] for row in rows),
        })  # fmt: skip
    if recompute:
        ttfts = [r["ttft_s"] for r in recompute]
        lines.insert(0, {
            "path": "recompute (no session)",
            "n": len(recompute),
            "ttft_median_s": statistics.median(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts),
            "restore_mean_s": 0.0,
            "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in recompute),
            "cached_tokens": 0.0,
            "record_mib": 0.0,
            "same_text": True,
        })  # fmt: skip
        base = lines[0]["ttft_median_s"]
        for line in lines:
            line["speedup"] = base / line["ttft_median_s"] if line["ttft_median_s"] > 0 else float("nan")
    return lines


def table(lines: list[dict[str, Any]]) -> str:
    head = (f"{'path':<24} {'n':>3} {'TTFT median':>12} {'TTFT mean':>10} {'restore':>8} {'prompt':>7} "
            f"{'cached':>7} {'record':>9} {'speedup':>8} {'same text':>9}")  # fmt: skip
    out = [head, "-" * len(head)]
    for x in lines:
        out.append(
            f"{x['path']:<24} {x['n']:>3} {x['ttft_median_s']:>11.3f}s {x['ttft_mean_s']:>9.3f}s "
            f"{x['restore_mean_s']:>7.3f}s {x['prompt_tokens']:>7.0f} {x['cached_tokens']:>7.0f} "
            f"{x['record_mib']:>6.1f}MiB {x['speedup']:>7.1f}x {'yes' if x['same_text'] else 'NO':>9}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny-random or a local folder")
    p.add_argument("--policy", default="full", help="the server's cache policy (full: both paths give the same text)")
    p.add_argument("--stores", default="local,s3,device", help="comma-separated: local, s3, device")
    p.add_argument("--s3-url", default=None, help="a real s3://BUCKET/PREFIX instead of moto (AWS_* from the env)")
    p.add_argument("--doc-tokens", type=int, default=1800, help="tokens of documentation pasted in turn 1")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn (greedy)")
    p.add_argument("--repeats", type=int, default=3, help="sessions per store (a new passage each)")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--kv-cache-dtype", default="auto", help="the server's pool (int8: records are kv-int8)")
    p.add_argument("--host-kv-dtype", default=None, help="the server's host tier and records, if not the pool's")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--device", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to become healthy")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (and store wait)")
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the whole run (then stop)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    if not kinds or set(kinds) - {"local", "s3", "device"}:
        p.error("--stores takes local, s3 and device")
    if args.repeats < 1 or args.doc_tokens < 16:
        p.error("--repeats must be >= 1 and --doc-tokens >= 16")
    deadline = time.monotonic() + args.time_limit
    t0 = time.monotonic()
    out: dict[str, Any] = {}
    for kind in kinds:
        if time.monotonic() > deadline:
            print(f"# time limit reached: {kind} skipped", file=sys.stderr)
            continue
        run_store(args, kind, deadline, out)
    lines = summary(out)
    print(table(lines))
    result = {
        "model": args.model,
        "policy": args.policy,
        "kv_cache_dtype": args.kv_cache_dtype,
        "host_kv_dtype": args.host_kv_dtype,
        "doc_tokens": args.doc_tokens,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "seconds": time.monotonic() - t0,
        "summary": lines,
        "runs": out,
    }
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
