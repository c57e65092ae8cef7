"""Gated promotion: a candidate version replaces the one under an alias only if it scores at least as well.

Both versions are evaluated with the tuner's own evaluation (``envs.evaluate.evaluate_policy``) on the held-out
split of one workload (``envs.episodes.build_episodes``), under the same reward the tuner optimises (memory saved
minus weighted KL to the full cache, plus the task bonus), so the gate judges by the criterion the policies were
trained for, on items none of them trained on. Both evaluations are recorded in the registry whatever the
verdict. The verdict compares the mean episode reward; a tie passes (an equal policy is no regression).

A learned policy that sets the rule's knobs must also beat its own constant (``envs.constant``): the plain
``dynamic`` rule with the network's median knobs over the decisions it took on the same items. Its per-item
reward margin needs a 95% bootstrap interval above zero; otherwise the network is a constant Optuna could have
found, and its promotion is refused (with the margin recorded beside its evaluation).

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
    constant: Any = None  # ``envs.constant.ConstantCheck`` of a learned knobs candidate

    @property
    def beats_current(self) -> bool:
        return self.current is None or self.candidate.metrics["reward"] >= self.current.metrics["reward"]

    @property
    def beats_constant(self) -> bool:
        return self.constant is None or self.constant.margin.above_zero

    @property
    def passed(self) -> bool:
        return self.beats_current and self.beats_constant

    def _constant_verdict(self) -> str:
        c = self.constant
        rel = "beats" if self.beats_constant else "does not beat"
        return f"candidate v{self.candidate.version} {rel} its own constant: margin {c.margin.text()}"

    def verdict(self) -> str:
        c = self.candidate
        word = "pass" if self.passed else "refused"
        if self.current is None:
            head = self.note or f"{self.policy}@{self.alias} holds no other version to compare against"
        else:
            cur = self.current
            rel = ">=" if self.beats_current else "<"
            head = (f"candidate v{c.version} reward {c.metrics['reward']:.4f} {rel} {self.alias} v{cur.version} "
                    f"reward {cur.metrics['reward']:.4f} on {self.workload}/{SPLIT}")  # fmt: skip
        if self.constant is not None:
            head = f"{head}; {self._constant_verdict()}"
        return f"{word}: {head}"

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
        if self.constant is not None:
            from envs.constant import constant_text

            lines.append(f"its constant: {constant_text(self.constant.knobs)}: reward "
                         f"{self.constant.constant['reward']:.4f}")  # fmt: skip
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
    from envs.constant import check_against_constant, is_network
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

    checks: dict[int, Any] = {}

    def side(version: int, against_constant: bool = False) -> GateSide:
        _, policy, _ = registry.load(name, version)
        extra: dict[str, Any] = {}
        if against_constant and is_network(policy):
            checks[version] = check = check_against_constant(data, policy, weights, seed, label=f"v{version}")
            metrics, extra = check.learned, {"state_dependence": check.to_dict()}
        else:
            metrics = evaluate_policy(data, policy, weights)
        recorded = {**metrics, **extra, "seed": seed, "weights": dict(weights.__dict__)}
        registry.add_evaluation(name, version, workload, SPLIT, recorded, model=model)
        return GateSide(version, metrics)

    result = GateResult(name, alias, workload, model, side(cand.version, True), None, dict(weights.__dict__))
    result.constant = checks.get(cand.version)
    result.seen_version = seen
    if seen == cand.version:
        result.note = f"{name}@{alias} already points at the candidate"
    if cur is not None:
        try:
            result.current = side(cur.version)
        except ArtifactError as err:  # a broken production version must not block its replacement
            result.note = f"the current {alias} version does not load ({err})"
    return result
