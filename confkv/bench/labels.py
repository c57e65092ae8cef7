"""Point labels that do not overlap, and markers that stay visible where points coincide.

Policies often land on the same spot of a plot (fixed baselines matched to one memory, a tuned policy beside the
rule it came from), and labels written at one fixed offset then pile into one unreadable string over the markers.
``place_labels`` tries, for each label in turn, a ring of positions around its point (nearest first, then further
out with a leader line) and keeps the first whose box overlaps no label placed before, no marker and nothing
outside the axes. A few labels on a small plot need nothing cleverer. ``MARKERS`` gives each series its own shape,
and ``dodge`` spreads markers that fall on the same spot a few pixels sideways (the values are unchanged; a
reader sees every policy that is there, not the last one drawn).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.transforms import Bbox, ScaledTranslation, Transform

#: One shape per series, in order, so series stay apart where colours are hard to tell.
MARKERS: tuple[str, ...] = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h", "*")
_RING = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))


def dodge(ax: Axes, points: Sequence[tuple[float, float]], spread: float = 9.0, near_px: float = 5.0) -> list[float]:
    """Horizontal offsets (typographic points) that spread markers lying within ``near_px`` pixels of each other
    ``spread`` points apart, centred on where they are; 0 for a marker alone."""
    ax.figure.canvas.draw()
    pix = [ax.transData.transform(p) for p in points]
    offsets = [0.0] * len(points)
    groups: list[list[int]] = []
    for i, (x, y) in enumerate(pix):
        for group in groups:
            gx, gy = pix[group[0]]
            if abs(x - gx) <= near_px and abs(y - gy) <= near_px:
                group.append(i)
                break
        else:
            groups.append([i])
    for group in groups:
        for j, i in enumerate(group):
            offsets[i] = (j - (len(group) - 1) / 2) * spread
    return offsets


def shifted(ax: Axes, dx_pt: float) -> Transform:
    """Data coordinates moved ``dx_pt`` typographic points sideways (a dodged marker's transform)."""
    return ax.transData + ScaledTranslation(dx_pt / 72.0, 0, ax.figure.dpi_scale_trans)


def _overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(
    ax: Axes,
    points: Sequence[tuple[float, float]],
    labels: Sequence[str],
    *,
    fontsize: float = 9,
    gap: float = 7.0,
    colors: Sequence[Any] | None = None,
    marker_px: float = 9.0,
    offsets: Sequence[float] | None = None,
) -> list[Any]:
    """Annotate each point (data coordinates) with its label where it overlaps nothing already drawn.

    ``gap`` is the distance from the point in typographic points; rings at 1, 2.5 and 4 times it are tried. A label
    placed beyond the first ring gets a thin leader line to its point. ``offsets``: each marker's sideways shift in
    points (``dodge``), which its label follows. Returns the annotations.
    """
    fig = ax.figure
    fig.canvas.draw()  # a renderer that knows the text extents and the final axes layout
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    to_px = fig.dpi / 72.0
    axes_box = ax.get_window_extent(renderer)
    shift = list(offsets) if offsets is not None else [0.0] * len(points)
    pts = []
    for p, dx in zip(points, shift, strict=True):
        x, y = ax.transData.transform(p)
        pts.append((float(x) + dx * to_px, float(y)))
    taken: list[Bbox] = [Bbox.from_extents(x - marker_px, y - marker_px, x + marker_px, y + marker_px) for x, y in pts]
    out = []
    for i, ((px, py), text) in enumerate(zip(pts, labels, strict=True)):
        probe = ax.text(0, 0, text, fontsize=fontsize)
        extent = probe.get_window_extent(renderer)
        probe.remove()
        w, h = extent.width, extent.height
        best: tuple[float, float, float, float] | None = None  # (cost, dx_pt, dy_pt, ring)
        for ring in (1.0, 2.5, 4.0):
            for sx, sy in _RING:
                dx = sx * gap * ring * to_px
                dy = sy * gap * ring * to_px
                x0 = px + dx - (w if sx < 0 else (w / 2 if sx == 0 else 0))
                y0 = py + dy - (h if sy < 0 else (h / 2 if sy == 0 else 0))
                box = Bbox.from_bounds(x0, y0, w, h)
                cost = sum(_overlap(box, t) for t in taken)
                inside = axes_box.x0 <= box.x0 and box.x1 <= axes_box.x1 and axes_box.y0 <= box.y0
                inside = inside and box.y1 <= axes_box.y1
                cost += 0.0 if inside else w * h
                cost += ring * 1e-3  # nearer wins a tie
                if best is None or cost < best[0]:
                    best = (cost, dx / to_px, dy / to_px, ring)
            if best is not None and best[0] < 1.0:
                break
        assert best is not None
        _, dx_pt, dy_pt, ring = best
        sx, sy = (dx_pt > 0) - (dx_pt < 0), (dy_pt > 0) - (dy_pt < 0)
        ha = "left" if sx > 0 else ("right" if sx < 0 else "center")
        va = "bottom" if sy > 0 else ("top" if sy < 0 else "center")
        color = colors[i] if colors is not None else "black"
        arrow = {"arrowstyle": "-", "color": color, "lw": 0.6, "alpha": 0.8} if ring > 1.0 else None
        ann = ax.annotate(text, points[i], xycoords=shifted(ax, shift[i]), xytext=(dx_pt, dy_pt),
                          textcoords="offset points", ha=ha, va=va, fontsize=fontsize, color=color, arrowprops=arrow,
                          zorder=5)  # fmt: skip
        x0 = px + dx_pt * to_px - (w if sx < 0 else (w / 2 if sx == 0 else 0))
        y0 = py + dy_pt * to_px - (h if sy < 0 else (h / 2 if sy == 0 else 0))
        taken.append(Bbox.from_bounds(x0, y0, w, h))
        out.append(ann)
    return out
