"""Gated promotion: a candidate version replaces the one under an alias only if it scores at least as well.

Both versions are evaluated with the tuner's own evaluation (``envs.evaluate.evaluate_policy``) on the held-out
split of one workload (``envs.episodes.build_episodes``), under the same reward the tuner optimises (memory saved
minus weighted KL to the full cache, plus the task bonus), so the gate judges by the criterion the policies were
trained for, on items none of them trained on. Both evaluations are recorded in the registry whatever the
verdict. The verdict compares the mean episode reward; a tie passes (an equal policy is no regression).

Neither MLflow nor Optuna gates an alias move; this is the step between "a run found something" and "production".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from store.errors import ArtifactError, RegistryError
from store.registry import Registry

SPLIT = "heldout"
SHOWN = ("reward", "kv_fraction", "kl_mean", "ppl", "passkey_acc", "episodes")


@dataclass
class GateSide:
    version: int
    metrics: dict[str, Any]


@dataclass
class GateResult:
    policy: str
    alias: str
    workload: str
    model: str
    candidate: GateSide
    current: GateSide | None  # None: the alias points at nothing yet (or at the candidate itself)
    weights: dict[str, float] = field(default_factory=dict)
    note: str | None = None  # why there is no current side although the alias is set
    seen_version: int | None = None  # what the alias pointed at when the check began (the promotion's expected)

    @property
    def passed(self) -> bool:
        return self.current is None or self.candidate.metrics["reward"] >= self.current.metrics["reward"]

    def verdict(self) -> str:
        c = self.candidate
        if self.current is None:
            return f"pass: {self.note or f'{self.policy}@{self.alias} holds no other version to compare against'}"
        cur = self.current
        rel = ">=" if self.passed else "<"
        word = "pass" if self.passed else "refused"
        return (
            f"{word}: candidate v{c.version} reward {c.metrics['reward']:.4f} {rel} "
            f"{self.alias} v{cur.version} reward {cur.metrics['reward']:.4f} on {self.workload}/{SPLIT}"
        )

    def table(self) -> str:
        """The two results side by side."""
        head = f"candidate v{self.candidate.version}"
        other = f"{self.alias} v{self.current.version}" if self.current else f"{self.alias} (none)"
        w = self.weights
        lines = [
            f"gate: {self.policy} on {self.workload}/{SPLIT}, model {self.model}; reward = "
            f"{w.get('memory_weight', 1):g} x memory saved - {w.get('quality_weight', 2):g} x KL "
            f"+ {w.get('task_weight', 1):g} x task",
            f"{'':<14}{head:>18}{other:>22}",
        ]
        for key in SHOWN:
            a = _fmt(self.candidate.metrics.get(key))
            b = _fmt(self.current.metrics.get(key)) if self.current else "-"
            lines.append(f"{key:<14}{a:>18}{b:>22}")
        lines.append(self.verdict())
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def run_gate(
    registry: Registry,
    name: str,
    candidate: int | str,
    alias: str,
    workload: str,
    *,
    model: str | None = None,
    seed: int = 0,
    device: str | None = None,
    weights: Any = None,
    sizes: dict[str, dict[str, Any]] | None = None,
) -> GateResult:
    """Evaluate the candidate and the alias's current version on ``workload``'s held-out split; record both."""
    from envs.env import RewardWeights
    from envs.episodes import TUNE_WORKLOADS, build_episodes
    from envs.evaluate import evaluate_policy

    if workload not in TUNE_WORKLOADS:
        raise RegistryError(f"unknown workload {workload!r} for --check; choose one of {', '.join(TUNE_WORKLOADS)}")
    weights = weights or RewardWeights()  # finite: RewardWeights refuses NaN and infinity
    cand = registry.get_version(name, candidate)
    seen = registry.alias_version(name, alias)
    current_version = None if seen == cand.version else seen
    cur = registry.get_version(name, current_version) if current_version is not None else None
    model = model or cand.model or (cur.model if cur else None)
    if not model:
        raise RegistryError(f"no model is recorded for {cand.ref}; pass --model")
    data = build_episodes(model, workload=workload, split=SPLIT, seed=seed, device=device, sizes=sizes)

    def side(version: int) -> GateSide:
        _, policy, _ = registry.load(name, version)
        metrics = evaluate_policy(data, policy, weights)
        recorded = {**metrics, "seed": seed, "weights": dict(weights.__dict__)}
        registry.add_evaluation(name, version, workload, SPLIT, recorded, model=model)
        return GateSide(version, metrics)

    result = GateResult(name, alias, workload, model, side(cand.version), None, dict(weights.__dict__))
    result.seen_version = seen
    if seen == cand.version:
        result.note = f"{name}@{alias} already points at the candidate"
    if cur is not None:
        try:
            result.current = side(cur.version)
        except ArtifactError as err:  # a broken production version must not block its replacement
            result.note = f"the current {alias} version does not load ({err})"
    return result
