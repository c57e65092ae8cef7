"""``confkv-tune demo``: what a tuned policy does, shown on prompts long enough that the policies differ.

``make run`` ends with it. One model, three policies, the same prompts: the full cache (the reference), the
requirement's dynamic rule at the sizes the tuner searched around (the *default rule*), and the tuned policy. The
prompts are the held-out split's own workload items, built offline and the same on every machine: pass-key prompts
(a number hidden at 10%, 50% and 90% of a long haystack, asked for at the end) and one long chat whose last
question needs a fact from its first turn, with documentation pasted in between. At these lengths every evicting
policy must evict, which a short prompt never makes it do. The summary table says how much KV each policy kept,
how many keys it found, how close its chat answer is to the full cache's, what the numbers mean, and where the
training run's MLflow record and registry version are; the full figures go to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from confkv.config import CachePolicy
from confkv.errors import ConfkvError
from confkv.policy_source import load_policy

#: Prompt sizes on smollm2-135m (about 2 minutes for the three policies on 2 CPU cores); toy sizes on tiny-random.
SIZES: dict[str, dict[str, Any]] = {
    "default": {"passkey": {"lengths": (1536,), "depths": (0.1, 0.5, 0.9)},
                "chat": {"turns": 3, "length": 1536, "max_tokens": 64}},
    "tiny": {"passkey": {"lengths": (300,), "depths": (0.2, 0.8)},
             "chat": {"turns": 3, "length": 800, "max_tokens": 16}},
}  # fmt: skip


def add_demo_command(sub: Any) -> None:
    demo = sub.add_parser("demo", help="the tuned policy beside the default rule and the full cache on long prompts: "
                          "a summary table, the figures as JSON")  # fmt: skip
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--policy-file", required=True, help="the tuned policy (a training run's OUT/policy)")
    demo.add_argument("--summary", default=None, help="that run's OUT/summary.json: its training figures, MLflow run "
                      "and registry version go into the table (default: beside --policy-file)")  # fmt: skip
    demo.add_argument("--out", default=None, help="JSON file for the figures (default: beside --policy-file)")
    demo.add_argument("--device", default=None)
    demo.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    demo.add_argument("--cache-dir", default=None)


def _kv_share(outs: list[Any]) -> float:
    """Resident keys over what the full cache holds on average while these requests generate (the bench's
    ``kv_fraction_engine``)."""
    held = sum(o.kv["mean_resident_tokens"] for o in outs)
    full = sum(o.prompt_tokens + (o.generated_tokens - 1) / 2 for o in outs)
    return held / full if full else 1.0


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def measure(model: str, policies: list[tuple[str, CachePolicy]], args: argparse.Namespace) -> dict[str, Any]:
    """Every policy on the same pass-key prompts and chat; the full cache must come first (the reference)."""
    from confkv.bench.textmetrics import rouge_l
    from confkv.bench.workloads import make_workload
    from confkv.engine.params import SamplingParams
    from confkv.llm import LLM
    from confkv.model_loader import load_model
    from confkv.progress import stage

    loaded = load_model(model, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir)
    sizes = SIZES["tiny" if model == "tiny-random" else "default"]
    keys = make_workload("passkey", loaded.tokenizer, split="heldout", n=1, **sizes["passkey"])
    (chat,) = make_workload("chat", loaded.tokenizer, split="heldout", n=1, **sizes["chat"])
    rows: list[dict[str, Any]] = []
    with stage("demo", total=len(policies), unit="policies") as progress:
        for name, policy in policies:
            progress.set_note(name)
            llm = LLM(model, policy, loaded=loaded, max_batch_size=len(keys) + 1)
            prompts = [list(it.prompt_ids) for it in (*keys, chat)]
            params = [SamplingParams(max_tokens=it.max_tokens) for it in (*keys, chat)]
            outs = llm.generate(prompts, params)
            llm.close()
            found = [bool(it.correct(o.text)) for it, o in zip(keys, outs, strict=False)]
            answer = outs[-1]
            rows.append({"policy": name, "controller": policy.controller, "kv_share": _kv_share(outs),
                         "passkeys_found": sum(found), "passkeys": len(keys), "passkey_found": found,
                         "chat_answer": answer.text, "chat_tokens": list(answer.token_ids),
                         "policy_settings": policy.model_dump(mode="json", exclude_none=True)})  # fmt: skip
            progress.update(1)
    reference = rows[0]
    for row in rows:
        row["chat_rougeL_vs_full"] = rouge_l([row["chat_answer"]], [reference["chat_answer"]])
        row["chat_same_tokens_as_full"] = _first_divergence(row["chat_tokens"], reference["chat_tokens"])
    return {
        "model": model,
        "passkey_prompts": [{"tokens": len(it.prompt_ids), "depth": it.meta["depth"], "key": it.answer} for it in keys],
        "chat_prompt_tokens": len(chat.prompt_ids),
        "chat_question": chat.meta.get("scenario"),
        "policies": rows,
    }


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def summary_text(result: dict[str, Any], train: dict[str, Any] | None, json_path: Path) -> str:
    """The table and what it means, for a person reading a terminal."""
    prompts = result["passkey_prompts"]
    depths = ", ".join(f"{100 * p['depth']:.0f}%" for p in prompts)
    width = max(len(r["label"]) for r in result["policies"])
    lines = [
        f"confkv demo on {result['model']}: {len(prompts)} pass-key prompts of {prompts[0]['tokens']:,} tokens (key at "
        f"{depths} depth) and a {result['chat_prompt_tokens']:,}-token chat whose last question needs its first turn",
        "",
        f"{'policy':<{width}}  KV share  pass keys  chat answer vs full",
    ]
    for r in result["policies"]:
        same = r["chat_same_tokens_as_full"]
        vs = "identical (the reference)" if r["controller"] == "full" else (
            f"ROUGE-L {r['chat_rougeL_vs_full']:.2f}, first {same} tokens identical")  # fmt: skip
        lines.append(
            f"{r['label']:<{width}}  {_pct(r['kv_share']):>8}  {r['passkeys_found']:>5}/{r['passkeys']:<3}  {vs}"
        )
    lines += [
        "",
        "What the numbers mean:",
        "  KV share: keys kept on the device while generating, as a share of what the full cache keeps (lower saves "
        "memory: more requests fit).",
        "  pass keys: prompts whose hidden number the policy repeated; the full cache's count is the bar.",
        "  chat answer vs full: ROUGE-L of the policy's answer to the chat against the full cache's (1.00: the same "
        "words), and how many tokens it wrote before it first differed.",
        "  A policy that keeps less memory but loses pass keys has traded retrieval for memory: the training reward "
        "weighs memory on every segment and an answer once per retrieval episode (`confkv-tune compare` shows the "
        "terms).",
    ]
    if train:
        tuned, default = train.get("train") or {}, train.get("default") or {}
        lines += [
            "",
            "Training (the tuner's own episodes, teacher-forced): reward "
            f"{tuned.get('reward', float('nan')):.3f} tuned vs {default.get('reward', float('nan')):.3f} default rule; "
            f"KV {_pct(tuned.get('kv_fraction'))} vs {_pct(default.get('kv_fraction'))}, KL "
            f"{tuned.get('kl_mean', float('nan')):.3f} vs {default.get('kl_mean', float('nan')):.3f}, pass keys "
            f"{_pct(tuned.get('passkey_acc'))} vs {_pct(default.get('passkey_acc'))}.",
        ]
        uri = train.get("tracking_uri") or "sqlite:///mlflow.db"
        lines.append(f"MLflow run {train.get('run_id')}: `mlflow ui --backend-store-uri {uri}`, experiment "
                     "confkv-tune.")  # fmt: skip
        reg = train.get("registry")
        if reg:
            promote = f"confkv-tune promote {reg['name']} {reg['version']}"
            lines.append(f"Registry version {reg['ref']} in {reg['url']}: serve it with `confkv serve --policy-file "
                         f"{reg['ref']}`, promote it with `{promote}`.")  # fmt: skip
        else:
            lines.append("Registry: not registered (--no-register, or the registry refused; see the training log).")
    lines.append(f"All figures and the answers: {json_path}")
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    from envs.episodes import default_base_policy

    tuned = load_policy(args.policy_file)  # a bad path fails before the model loads
    folder = Path(args.policy_file)
    base = folder if folder.is_dir() else folder.parent
    summary_path = Path(args.summary) if args.summary else base.parent / "summary.json"
    train = None
    if summary_path.is_file():
        try:
            train = json.loads(summary_path.read_text())
        except ValueError as err:
            raise ConfkvError(f"--summary {summary_path} is not JSON: {err}") from None
    elif args.summary:
        raise ConfkvError(f"--summary {summary_path} does not exist")
    out = Path(args.out) if args.out else base.parent / "demo.json"
    policies = [
        ("full", CachePolicy(controller="full")),
        ("default", default_base_policy(args.model)),
        ("tuned", tuned),
    ]
    labels = {"full": "full cache (keeps everything)", "default": "default rule (dynamic, the tuner's start)",
              "tuned": f"tuned ({args.policy_file})"}  # fmt: skip
    result = measure(args.model, policies, args)
    for row in result["policies"]:
        row["label"] = labels[row["policy"]]
    result["training"] = train
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(summary_text(result, train, out))
    sys.stdout.flush()
    return 0
