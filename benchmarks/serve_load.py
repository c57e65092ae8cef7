"""Load test of an OpenAI-compatible server: N concurrent streaming chat clients for T seconds, on loopback.

    python benchmarks/serve_load.py --model smollm2-135m --target confkv --policies full,dynamic \
        --clients 16 --duration 120 --max-tokens 64 --kv-cache-memory 64MiB
    python benchmarks/serve_load.py --model smollm2-135m --target transformers --hf-python .venv-hf/bin/python
    python benchmarks/serve_load.py --model tiny-random --policies full --replicas 0,1,2 --clients 4 --duration 45

``--replicas 0,1,2`` runs each policy on a plain ``confkv serve`` (0), then on ``confkv serve --replicas 1`` and
``--replicas 2`` (Ray Serve, ``--replica-cpus`` each): the difference between 0 and 1 at the same load is what the
Ray hop (its HTTP proxy, the router, the replica actor call) adds to each request; 2 against 1 is scaling, which on
a machine with fewer cores than replicas times ``--replica-cpus`` shows contention rather than a speedup.

For each run the script starts the server itself (``confkv serve`` with each policy under the same
``--kv-cache-memory`` pool, or ``transformers serve --continuous-batching`` from a separate virtual environment:
``make hf-serve-env``), waits for ``/health``, sends one warm-up request, then runs ``--clients`` clients that each
send greedy streaming chat requests back to back until ``--duration`` seconds have passed. Requests in flight at the
deadline may finish for up to ``--drain-timeout`` seconds (then they are cancelled and counted as errors); the
server is then stopped. Everything is bounded and stops by itself; traffic goes to 127.0.0.1 only.

Reported per run: completed requests, requests/s and output tokens/s over the whole run (deadline plus drain), time
to first token and end-to-end latency percentiles, errors, and for confkv the peak KV pool use and running requests
sampled from ``/metrics``. ``--out FILE`` writes the same as JSON.

``transformers serve`` takes a local model folder (it loads it with ``from_pretrained``, offline here): tiny-random
is saved to a folder first, smollm2-135m uses confkv's converted safetensors copy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import PROMPTS as COMMON_PROMPTS  # noqa: E402

from confkv.server.launcher import ServerProcess, free_port, serve_command  # noqa: E402

#: Chat prompts of different lengths (common.py's eight and eight more); client k starts at prompt k and walks the list.
PROMPTS = [
    *COMMON_PROMPTS,
    "How does a refrigerator keep food cold?",
    "Name three famous painters and one painting by each.",
    "What are the main differences between a lake and a sea?",
    "Suggest a weekly plan for someone starting to run.",
    "Explain what a hash table is to a new programmer.",
    "Why is the sky blue during the day and red at sunset?",
    "Write a polite message declining a meeting invitation.",
    "What should I pack for a three-day hiking trip?",
]


# --------------------------------------------------------------------------------------------------- servers
def start_confkv(args: argparse.Namespace, policy: str, replicas: int = 0) -> ServerProcess:
    flags = ["--model", args.model, "--cache-policy", policy, "--max-batch-size", str(args.max_batch_size),
             "--log-level", "warning"]  # fmt: skip
    if replicas:
        flags += ["--replicas", str(replicas), "--replica-cpus", str(args.replica_cpus),
                  "--max-ongoing-requests", str(args.max_batch_size)]  # fmt: skip
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", args.kv_cache_memory]
    if args.device:
        flags += ["--device", args.device]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    for item in args.set if policy == "dynamic" else []:
        flags += ["--set", item]
    name = f"confkv serve ({policy}{f', {replicas} replicas' if replicas else ''})"
    env = {"RAY_AUTH_MODE": "disabled"} if replicas else None  # a local, throwaway cluster
    return ServerProcess(serve_command(*flags), env=env, cwd=REPO, name=name, start_timeout=args.start_timeout,
                         stop_timeout=120.0)  # fmt: skip


def hf_model_folder(model: str) -> Path:
    """A local folder ``transformers serve`` can load offline for ``model``."""
    from confkv.model_loader import SMOLLM2, TINY_RANDOM, cache_root, load_model, model_folder

    if model == TINY_RANDOM:
        from confkv.model_loader import tiny_random_model, tiny_random_tokenizer

        folder = cache_root() / "models" / "tiny-random-seed0"
        if not (folder / "config.json").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tiny_random_model(0).save_pretrained(folder)
            tiny_random_tokenizer().save_pretrained(folder)
        return folder
    if model == SMOLLM2:
        folder = model_folder(SMOLLM2)
        if not (folder / "config.json").is_file():
            load_model(SMOLLM2, device="cpu")  # converts the packaged GGUF once
        return folder
    return Path(model).resolve()


def start_transformers(args: argparse.Namespace) -> tuple[ServerProcess, str]:
    folder = hf_model_folder(args.model)
    hf_bin = Path(args.hf_python).parent / "transformers"
    launcher = [str(hf_bin)] if hf_bin.exists() else [args.hf_python, "-m", "transformers.cli.transformers"]
    port = free_port()
    cmd = [*launcher, "serve", str(folder), "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
           "--device", args.device or "cpu", "--log-level", "warning"]  # fmt: skip
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    name = "transformers serve --continuous-batching"
    url = f"http://127.0.0.1:{port}"
    return ServerProcess(cmd, env=env, cwd=REPO, url=url, name=name, start_timeout=args.start_timeout), str(folder)


# ------------------------------------------------------------------------------------------------------ load
@dataclass
class RunResult:
    target: str
    policy: str | None
    clients: int
    replicas: int  # 0: one engine without Ray; N: confkv serve --replicas N
    duration_s: float
    dtype: str | None = None  # as asked for; None: the server's default
    wall_s: float = 0.0
    requests: int = 0
    errors: int = 0
    output_tokens: int = 0
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    ttft_s: dict[str, float] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    tokens_counted_by: str = "usage"
    error_samples: list[str] = field(default_factory=list)
    server: dict[str, float] = field(default_factory=dict)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50": qs[49], "p90": qs[89], "p99": qs[98], "mean": statistics.fmean(values)}


async def run_load(
    server: ServerProcess, model: str, args: argparse.Namespace, result: RunResult, send_usage: bool
) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=args.request_timeout)
    ttfts: list[float] = []
    latencies: list[float] = []
    counted_by_chunks = False
    extra = {"stream_options": {"include_usage": True}} if send_usage else {}

    async def one(prompt: str) -> None:
        nonlocal counted_by_chunks
        t0 = time.perf_counter()
        first = None
        chunks = 0
        usage = None
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
            temperature=0, stream=True, **extra,
        )  # fmt: skip
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                if first is None:
                    first = time.perf_counter()
        t1 = time.perf_counter()
        if usage is None:
            counted_by_chunks = True
        result.output_tokens += usage.completion_tokens if usage is not None else chunks
        result.requests += 1
        ttfts.append((first or t1) - t0)
        latencies.append(t1 - t0)

    async def worker(k: int, deadline: float) -> None:
        i = k
        while time.perf_counter() < deadline:
            try:
                await one(PROMPTS[i % len(PROMPTS)])
            except asyncio.CancelledError:
                result.errors += 1
                result.error_samples.append("cancelled at the drain timeout")
                raise
            except Exception as err:
                result.errors += 1
                if len(result.error_samples) < 5:
                    result.error_samples.append(f"{type(err).__name__}: {err}"[:300])
                await asyncio.sleep(0.1)
            i += 1

    async def sample_metrics(stop: asyncio.Event) -> None:
        peak_usage = peak_running = 0.0
        while not stop.is_set():
            try:
                status, text = await asyncio.to_thread(server.request, "GET", "/metrics", timeout=5)
            except OSError:
                status, text = 0, ""
            if status == 200:
                for line in text.splitlines():
                    # one series per replica under --replicas (labelled replica="..."): the largest of them
                    if line.startswith(("confkv:kv_cache_usage_perc ", "confkv:kv_cache_usage_perc{")):
                        peak_usage = max(peak_usage, float(line.split()[-1]))
                    elif line.startswith(("confkv:num_requests_running ", "confkv:num_requests_running{")):
                        peak_running = max(peak_running, float(line.split()[-1]))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        result.server = {"peak_kv_cache_usage_perc": peak_usage, "peak_requests_running": peak_running}

    await one(PROMPTS[0])  # warm-up, not counted
    result.requests = result.output_tokens = 0
    ttfts.clear()
    latencies.clear()

    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_metrics(stop)) if result.target == "confkv" else None
    start = time.perf_counter()
    deadline = start + args.duration
    tasks = [asyncio.create_task(worker(k, deadline)) for k in range(args.clients)]
    await asyncio.sleep(args.duration)
    _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    result.wall_s = time.perf_counter() - start
    stop.set()
    if sampler is not None:
        await sampler
    await client.close()
    result.requests_per_s = result.requests / result.wall_s
    result.output_tokens_per_s = result.output_tokens / result.wall_s
    result.ttft_s = percentiles(ttfts)
    result.latency_s = percentiles(latencies)
    result.tokens_counted_by = "content chunks" if counted_by_chunks else "usage"


# ---------------------------------------------------------------------------------------------------- report
def table(results: list[RunResult]) -> str:
    def ms(d: dict[str, float], k: str) -> str:
        return f"{1000 * d[k]:.0f}" if k in d else "-"

    lines = [
        "| server | policy | replicas | clients | requests | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | "
        "latency p50 / p90 / p99 (ms) | errors | peak KV pool use |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in results:
        peak = r.server.get("peak_kv_cache_usage_perc")
        lines.append(
            f"| {r.target} | {r.policy or '-'} | {r.replicas or '-'} | {r.clients} | {r.requests} | "
            f"{r.requests_per_s:.2f} | "
            f"{r.output_tokens_per_s:.1f} | {ms(r.ttft_s, 'p50')} / {ms(r.ttft_s, 'p90')} / {ms(r.ttft_s, 'p99')} | "
            f"{ms(r.latency_s, 'p50')} / {ms(r.latency_s, 'p90')} / {ms(r.latency_s, 'p99')} | {r.errors} | "
            f"{f'{100 * peak:.0f}%' if peak is not None else '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=["confkv", "transformers"], default="confkv")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-random or a local folder")
    p.add_argument("--policies", default="full,dynamic", help="confkv policies to run, each under the same pool")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dynamic policy overrides")
    p.add_argument("--kv-cache-memory", default="256MiB", help="confkv's KV pool, the same for every policy")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=60.0, help="seconds during which requests are started")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds in-flight requests may finish")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--device", default=None, help="cpu (default for transformers serve), cuda ...")
    p.add_argument("--dtype", default=None, help="model dtype for either server (default: each server's own)")
    p.add_argument("--hf-python", default=str(REPO / ".venv-hf" / "bin" / "python"), help="python of .venv-hf")
    p.add_argument("--replicas", default="0", help="confkv: comma-separated replica counts, 0 = no Ray (e.g. 0,1,2)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        p.error("--clients must be >= 1 and --duration > 0")

    results: list[RunResult] = []
    if args.target == "confkv":
        counts = [int(n) for n in args.replicas.split(",") if n.strip()]
        runs = [(pol.strip(), n) for pol in args.policies.split(",") if pol.strip() for n in counts]
    else:
        if not Path(args.hf_python).exists():
            p.error(f"{args.hf_python} not found: `make hf-serve-env` creates .venv-hf with transformers[serving]")
        runs = [(None, None)]
    for policy, replicas in runs:
        if policy is not None:
            srv, model_name = start_confkv(args, policy, replicas or 0), args.model
        else:
            srv, model_name = start_transformers(args)
        try:
            r = RunResult(args.target, policy, args.clients, replicas or 0, args.duration, args.dtype)
            print(f"# {srv.name}: {args.clients} clients for {args.duration:.0f}s ...", file=sys.stderr, flush=True)
            asyncio.run(run_load(srv, model_name, args, r, send_usage=args.target == "confkv"))
            results.append(r)
        finally:
            code = srv.stop()
            if code not in (0, None, -signal.SIGTERM):
                print(f"# {srv.name} exited with {code}:\n{srv.log[-2000:]}", file=sys.stderr)
    print(table(results))
    for r in results:
        for e in r.error_samples:
            print(f"# {r.target}/{r.policy}: {e}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
