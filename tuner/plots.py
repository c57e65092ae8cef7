"""The tuner's plots: an RL run's learning curve, an Optuna study's trials, and a comparison's policies."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def learning_curve(
    out: Path,
    title: str,
    episodes: list[tuple[float, float]],
    evals: list[tuple[float, float]],
    default: float,
    evaluated_on: str = "all training episodes",
    baseline: str = "default rule",
) -> None:
    """Episode rewards (dots), their running mean over 20, the deterministic policy's evaluations (line) and the
    baseline's reward on the episodes they were evaluated on (dashed); the legend names those episodes, since a run
    with a validation share evaluates on items it does not train on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    if episodes:
        xs, ys = map(np.array, zip(*episodes, strict=True))
        ax.scatter(xs, ys, s=6, alpha=0.3, label="episode reward")
        k = min(20, len(ys))
        ax.plot(xs[k - 1 :], np.convolve(ys, np.ones(k) / k, mode="valid"), lw=1.5, label=f"mean of {k} episodes")
    if evals:
        ex, ey = zip(*evals, strict=True)
        ax.plot(ex, ey, marker="o", lw=2, label=f"deterministic policy, {evaluated_on}")
    ax.axhline(default, ls="--", c="gray", label=baseline)
    ax.set_xlabel("timestep (segments)")
    ax.set_ylabel("reward per episode")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_curve.png", dpi=110)
    plt.close(fig)


def optuna_trials_plot(path: Path, study: Any) -> Path | None:
    """Every finished trial of ``study`` at its resident KV fraction and KL to full, coloured by its reward (the
    colour bar says so), with the best trial and the default rule (the first trial of a new study) marked, and the
    trials that answered fewer retrieval items than the default rule ringed: a reader sees at once which corner the
    search went to and what it gave up there. Pruned trials have no figures of their own; the title counts them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tuner.search import best_trial

    done = [t for t in study.trials if t.state.name == "COMPLETE" and "kv_fraction" in t.user_attrs]
    if not done:
        return None
    pruned = sum(t.state.name == "PRUNED" for t in study.trials)
    pareto = len(study.directions) > 1
    xs = [t.user_attrs["kv_fraction"] for t in done]
    ys = [t.user_attrs["kl_mean"] for t in done]
    colour = [t.number for t in done] if pareto else [t.value for t in done]
    fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
    cut = [t for t in study.trials if t.state.name == "PRUNED" and "partial_kv_fraction" in t.user_attrs]
    pruned_pts = [(t.user_attrs["partial_kv_fraction"], t.user_attrs["partial_kl_mean"], t.number) for t in cut]
    handles = []
    if pruned_pts:
        handles.append(ax.scatter([p[0] for p in pruned_pts], [p[1] for p in pruned_pts], marker="x", s=40,
                                  color="0.45", zorder=3,
                                  label="pruned after its first group (that group's figures)"))  # fmt: skip
    dots = ax.scatter(xs, ys, c=colour, cmap="viridis", s=45, edgecolor="black", linewidth=0.4, zorder=3)
    bar = fig.colorbar(dots, ax=ax)
    bar.set_label("trial number" if pareto else "trial reward (higher is better)")
    default = next((t for t in done if t.user_attrs.get("enqueued") == "default"), None)

    def retrieval(t: Any) -> float:
        return sum(t.user_attrs.get(k) or 0.0 for k in ("passkey_acc", "multikey_acc"))

    if default is not None:
        lost = [t for t in done if retrieval(t) < retrieval(default) - 1e-9]
        if lost:
            lx, ly = [t.user_attrs["kv_fraction"] for t in lost], [t.user_attrs["kl_mean"] for t in lost]
            handles.append(ax.scatter(lx, ly, s=170, facecolors="none", edgecolors="crimson", linewidths=1.4, zorder=2,
                                      label="answered fewer retrieval items than the default rule"))  # fmt: skip
        handles.append(ax.scatter([default.user_attrs["kv_fraction"]], [default.user_attrs["kl_mean"]], marker="s",
                                  s=110, facecolors="none", edgecolors="black", linewidths=1.6, zorder=4,
                                  label=f"default rule (trial {default.number})"))  # fmt: skip
    best = best_trial(study)
    if "kv_fraction" in best.user_attrs:
        value = "" if pareto else f", reward {best.value:.3f}"
        handles.append(ax.scatter([best.user_attrs["kv_fraction"]], [best.user_attrs["kl_mean"]], marker="*", s=320,
                                  color="gold", edgecolors="black", linewidths=0.9, zorder=5,
                                  label=f"best: trial {best.number}{value} (the exported policy)"))  # fmt: skip
    from confkv.bench.labels import place_labels

    ax.margins(0.1)
    points = list(zip(xs, ys, strict=True)) + [(x, y) for x, y, _ in pruned_pts]
    numbers = [str(t.number) for t in done] + [str(n) for _, _, n in pruned_pts]
    place_labels(ax, points, numbers, fontsize=7, gap=4.0, colors=["0.35"] * len(points), marker_px=6.0)
    ax.set_xlabel("resident KV fraction (lower saves more memory)")
    ax.set_ylabel("mean KL to full (nats, lower is closer to full)")
    extra = f", {pruned} pruned after their first group" if pruned else ""
    ax.set_title(f"Optuna trials of {study.study_name}\n{len(done)} finished{extra}; labels are trial numbers",
                 fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, loc="best", fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare_plot(path: Path, rows: list[dict[str, Any]], title: str) -> Path:
    """Each compared policy at its resident KV fraction and KL to full, one marker shape per policy, labels placed
    where they overlap nothing (``confkv.bench.labels``), and a policy that answered fewer retrieval items than the
    full cache ringed in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from confkv.bench.labels import MARKERS, dodge, place_labels, shifted

    fig, ax = plt.subplots(figsize=(9, 6), layout="constrained")
    cmap = plt.get_cmap("tab10")
    xy = [(r["kv_fraction"], r["kl_mean"]) for r in rows]
    colours = [cmap(i % 10) for i in range(len(rows))]
    ax.set_xlim(0, 1.08)
    top = max((y for _, y in xy), default=0.0)
    ax.set_ylim(-0.06 * (top or 1.0), 1.15 * (top or 1.0))
    offsets = dodge(ax, xy)
    handles = []
    for i, (r, (x, y), dx) in enumerate(zip(rows, xy, offsets, strict=True)):
        marker = MARKERS[i % len(MARKERS)]
        handles.append(ax.scatter([x], [y], s=80, marker=marker, color=colours[i], zorder=3, edgecolor="black",
                                  linewidth=0.5, transform=shifted(ax, dx), label=r["policy"]))  # fmt: skip
        if r.get("retrieval_lost"):
            ax.scatter([x], [y], s=260, facecolors="none", edgecolors="crimson", linewidths=1.4, zorder=2,
                       transform=shifted(ax, dx))  # fmt: skip
    place_labels(ax, xy, [r["policy"] for r in rows], colors=colours, offsets=offsets)
    if any(r.get("retrieval_lost") for r in rows):
        handles.append(ax.scatter([], [], s=160, facecolors="none", edgecolors="crimson", linewidths=1.4,
                                  label="answered fewer retrieval items than full"))  # fmt: skip
    ax.set_xlabel("resident KV fraction (lower saves more memory)")
    ax.set_ylabel("mean KL to full (nats, lower is better)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="policy")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
