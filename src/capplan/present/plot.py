"""Pictures: simulate's bars, optimize's trade-off curve, and the plan itself (graphs per
capture size and LoRA case, per mode; a diff of two plans). SVG is written directly (no
dependency); PNG goes through matplotlib (the `plot` extra)."""

from __future__ import annotations

import io
from pathlib import Path
from xml.sax.saxutils import escape

from capplan.errors import UsageError
from capplan.install_hints import pip_install

W, H, PAD = 760, 300, 56
CHAR = 0.62  # a character's width per unit of font size (sans-serif, a little over the average)
EAGER = "#999999"  # the bar of steps that ran eager


def text_width(text: str, size: float) -> float:
    """How wide `text` is drawn at font size `size`, estimated (no font metrics in an SVG writer)."""
    return len(text) * size * CHAR


def wrap(text: str, size: float, width: float) -> list[str]:
    """`text` in lines no wider than `width` at font size `size`, broken at spaces (a word
    too long for a line is broken where the line ends): a picture cuts no text."""
    per_line = max(1, int(width / (size * CHAR)))
    lines: list[str] = []
    line = ""
    for word in text.split(" "):
        while len(word) > per_line:
            if line:
                lines.append(line)
                line = ""
            lines.append(word[:per_line])
            word = word[per_line:]
        candidate = f"{line} {word}" if line else word
        if len(candidate) <= per_line:
            line = candidate
        else:
            lines.append(line)
            line = word
    return [*lines, line] if line or not lines else lines


def tick_labels(centers: list[float], labels: list[str], size: float, gap: float = 8.0) -> list[int]:
    """Which of the labels centred at `centers` to draw so no two overlap: the first and the
    last always, the others left to right wherever they fit."""
    if not labels:
        return []

    def span(i: int) -> tuple[float, float]:
        half = text_width(labels[i], size) / 2
        return centers[i] - half, centers[i] + half

    last = len(labels) - 1
    chosen = [0]
    for i in range(1, last):
        if span(i)[0] >= span(chosen[-1])[1] + gap and span(i)[1] + gap <= span(last)[0]:
            chosen.append(i)
    if last:
        if span(last)[0] < span(chosen[-1])[1] + gap:  # only the first can be that close: keep the last
            chosen.pop()
        chosen.append(last)
    return chosen


def _caption(text: str, x: float, y: float, size: float, width: float) -> tuple[list[str], float]:
    """A caption wrapped to `width`: its <text> lines and the height it takes."""
    lines = wrap(text, size, width)
    step = size + 4
    out = [
        f'<text x="{x}" y="{y + i * step:.0f}" font-size="{size}">{escape(line)}</text>' for i, line in enumerate(lines)
    ]
    return out, (len(lines) - 1) * step


def _panel(title: str, xs: list[str], ys: list[float], top: float, color: str, ylabel: str) -> list[str]:
    h = H - 2 * PAD
    peak = max(ys) if ys and max(ys) > 0 else 1.0
    out = [
        f'<text x="{PAD}" y="{top - 8}" font-size="13"><tspan font-weight="bold">{escape(title)}</tspan> '
        f"({escape(ylabel)}, max {peak:g})</text>"
    ]
    bw = (W - 2 * PAD) / max(len(xs), 1)
    out.append(f'<line x1="{PAD}" y1="{top + h}" x2="{W - PAD}" y2="{top + h}" stroke="#333"/>')
    out.append(f'<line x1="{PAD}" y1="{top}" x2="{PAD}" y2="{top + h}" stroke="#333"/>')
    for tick in _ticks(peak):  # the y-axis scale: a few round values, each with its grid line
        y = top + h - h * tick / peak
        out.append(f'<line x1="{PAD - 4}" y1="{y:.1f}" x2="{W - PAD}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{PAD - 6}" y="{y + 3:.1f}" font-size="9" text-anchor="end">{_tick_label(tick)}</text>')
    for i, (x, y) in enumerate(zip(xs, ys)):
        bh = max(h * y / peak, 1.0) if y > 0 else 0.0  # a bucket with steps stays visible
        fill = EAGER if x == "eager" else color
        out.append(
            f'<rect x="{PAD + i * bw + 1:.1f}" y="{top + h - bh:.1f}" width="{max(bw - 2, 1):.1f}" '
            f'height="{bh:.1f}" fill="{fill}"><title>{escape(x)}: {y:g}</title></rect>'
        )
    centers = [PAD + i * bw + bw / 2 for i in range(len(xs))]
    for i in tick_labels(centers, xs, 9):
        out.append(
            f'<text x="{centers[i]:.1f}" y="{top + h + 14}" font-size="9" text-anchor="middle">{escape(xs[i])}</text>'
        )
    return out


def _ticks(peak: float) -> list[float]:
    """Round values from 0 to at most `peak` for a y-axis: 1, 2 or 5 times a power of ten apart,
    at most six of them."""
    import math

    raw = peak / 5
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(peak / step + 1e-9) + 1)]


def _tick_label(value: float) -> str:
    if value >= 1000 and value == int(value):
        return f"{value / 1000:g}k"
    return f"{value:g}"


def _svg(panels: list[tuple[str, list[str], list[float], str, str]], caption: str) -> str:
    lines, extra = _caption(caption, 8, 18, 12, W - 16)
    height = len(panels) * (H - PAD) + PAD + extra
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height:.0f}" '
        f'viewBox="0 0 {W} {height:.0f}" font-family="sans-serif">',
        f'<rect width="{W}" height="{height:.0f}" fill="white"/>',
        *lines,
    ]
    for n, (title, xs, ys, color, ylabel) in enumerate(panels):
        body += _panel(title, xs, ys, 44 + extra + n * (H - PAD), color, ylabel)
    body.append("</svg>")
    return "\n".join(body) + "\n"


def _png(panels: list[tuple[str, list[str], list[float], str, str]], caption: str) -> bytes:
    try:
        import matplotlib

        matplotlib.use("Agg")
        matplotlib.rcParams["text.parse_math"] = False  # a file name with `$` is text, not TeX math
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("PNG plots need matplotlib", f"{pip_install('plot')}, or give a .svg path") from None
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (title, xs, ys, color, ylabel) in zip(axes[:, 0], panels):
        ax.bar(range(len(xs)), ys, color=[EAGER if x == "eager" else color for x in xs])
        step = max(1, len(xs) // 16)
        ax.set_xticks(range(0, len(xs), step), [xs[i] for i in range(0, len(xs), step)], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel, fontsize=9)
    fig.suptitle(caption, fontsize=10)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    return image.getvalue()


def plot_bars(path: Path, panels: list[tuple[str, list[str], list[float], str, str]], caption: str) -> str | bytes:
    """Bar panels as the image `path`'s suffix asks for (SVG text or PNG bytes); writes nothing."""
    return _render(path, lambda: _svg(panels, caption), lambda: _png(panels, caption))


def simulation_panels(data: dict) -> list[tuple[str, list[str], list[float], str, str]]:
    """Steps and padded tokens per captured size, and the steps that ran eager (no padding)
    as the last bucket: on a trace past the largest graph it is the largest one."""
    sizes = [str(r["num_tokens"]) for r in data["by_size"]] + ["eager"]
    steps = [r["steps"] for r in data["by_size"]] + [data["eager_steps"]]
    padded = [r["padded_tokens"] for r in data["by_size"]] + [0]
    return [
        ("steps per captured size, and eager", sizes, steps, "#4477aa", "steps"),
        ("padded tokens per captured size (eager pads none)", sizes, padded, "#cc6677", "padded tokens"),
    ]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        matplotlib.rcParams["text.parse_math"] = False  # a file name with `$` is text, not TeX math
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("PNG plots need matplotlib", f"{pip_install('plot')}, or give a .svg path") from None
    return plt


def _png_bytes(fig) -> bytes:
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    _pyplot().close(fig)
    return image.getvalue()


def _render(path: Path, svg, png) -> str | bytes:
    """`svg()` or `png()`, by the suffix of the path the picture is for."""
    suffix = path.suffix.lower()
    if suffix == ".svg":
        return svg()
    if suffix == ".png":
        return png()
    raise UsageError(f"--plot {path}: unknown image type {suffix or '(none)'!r}", "use a .svg or .png path")


# --- optimize: the trade-off curve --------------------------------------------------------

FLOOR = 0.001  # padding % drawn for a point with none (a log axis has no zero)


def plot_curve(path: Path, points: list, chosen, budget_graphs: int | None, caption: str) -> str | bytes:
    """Padding (log scale) against graphs captured, the chosen point and the graph budget marked."""
    xs = [p.graphs for p in points]
    ys = [max(100 * p.padding_overhead, FLOOR) for p in points]
    return _render(
        path,
        lambda: _curve_svg(xs, ys, chosen, budget_graphs, caption),
        lambda: _curve_png(xs, ys, chosen, budget_graphs, caption),
    )


def _curve_svg(xs: list[int], ys: list[float], chosen, budget: int | None, caption: str) -> str:
    import math

    lines, extra = _caption(caption, 8, 18, 12, W - 16)
    left, top, w, h = PAD + 10, 40 + extra, W - 2 * PAD - 10, H - 90
    height = H + extra
    x_max = max(xs + ([budget] if budget else [])) or 1
    lo, hi = math.log10(min(ys)), math.log10(max(ys))
    if hi - lo < 1e-9:
        lo, hi = lo - 1, hi + 1

    def px(x: float) -> float:
        return left + w * x / x_max

    def py(y: float) -> float:
        return top + h - h * (math.log10(y) - lo) / (hi - lo)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height:.0f}" '
        f'viewBox="0 0 {W} {height:.0f}" font-family="sans-serif">',
        f'<rect width="{W}" height="{height:.0f}" fill="white"/>',
        *lines,
        f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="#333"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#333"/>',
        f'<text x="{left + w / 2}" y="{top + h + 32}" font-size="11" text-anchor="middle">graphs captured</text>',
        f'<text x="12" y="{top + h / 2}" font-size="11" transform="rotate(-90 12 {top + h / 2})" '
        'text-anchor="middle">padding % of real tokens (log)</text>',
    ]
    for e in range(math.floor(lo), math.ceil(hi) + 1):
        if lo <= e <= hi:
            out.append(
                f'<line x1="{left - 4}" y1="{py(10**e):.1f}" x2="{left + w}" y2="{py(10**e):.1f}" stroke="#ddd"/>'
            )
            out.append(f'<text x="{left - 6}" y="{py(10**e) + 3:.1f}" font-size="9" text-anchor="end">{10**e:g}</text>')
    for k in range(6):
        x = x_max * k / 5
        out.append(f'<text x="{px(x):.1f}" y="{top + h + 14}" font-size="9" text-anchor="middle">{x:.0f}</text>')
    path = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y) in enumerate(zip(xs, ys)))
    out.append(f'<path d="{path}" fill="none" stroke="#228833" stroke-width="1.5"/>')
    for x, y in zip(xs, ys):
        out.append(
            f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2" fill="#228833"><title>{x} graphs: {y:g}%</title></circle>'
        )
    if budget:
        out.append(
            f'<line x1="{px(budget):.1f}" y1="{top}" x2="{px(budget):.1f}" y2="{top + h}" stroke="#cc3311" '
            'stroke-dasharray="4 3"/>'
        )
        out.append(_label_beside(px(budget), top + 12, 4, f"budget {budget}", 10, "#cc3311"))
    cy = max(100 * chosen.padding_overhead, FLOOR)
    out.append(
        f'<circle cx="{px(chosen.graphs):.1f}" cy="{py(cy):.1f}" r="6" fill="none" stroke="#0077bb" stroke-width="2"/>'
    )
    label = f"chosen: {chosen.graphs} graphs, {100 * chosen.padding_overhead:.2f}%"
    out.append(_label_beside(px(chosen.graphs), max(py(cy) - 8, top + 10), 8, label, 10, "#0077bb"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _label_beside(x: float, y: float, gap: float, text: str, size: float, color: str) -> str:
    """A label right of `x`, or left of it where the right side has no room."""
    if x + gap + text_width(text, size) <= W - 4:
        return f'<text x="{x + gap:.1f}" y="{y:.1f}" font-size="{size}" fill="{color}">{escape(text)}</text>'
    return (
        f'<text x="{x - gap:.1f}" y="{y:.1f}" font-size="{size}" fill="{color}" text-anchor="end">{escape(text)}</text>'
    )


def _curve_png(xs: list[int], ys: list[float], chosen, budget: int | None, caption: str) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, ys, marker=".", color="#228833")
    ax.set_yscale("log")
    if budget:
        ax.axvline(budget, color="#cc3311", linestyle="--", label=f"budget {budget}")
    ax.scatter(
        [chosen.graphs],
        [max(100 * chosen.padding_overhead, FLOOR)],
        s=120,
        facecolors="none",
        edgecolors="#0077bb",
        linewidths=2,
        label=f"chosen: {chosen.graphs} graphs",
        zorder=3,
    )
    ax.set_xlabel("graphs captured")
    ax.set_ylabel("padding % of real tokens (log)")
    ax.set_title(caption, fontsize=10)
    ax.legend()
    fig.tight_layout()
    return _png_bytes(fig)


# --- the plan: graphs per capture size and LoRA case ---------------------------------------

CAPTURED, PRUNED, ADDED, REMOVED = "#4477aa", "#dddddd", "#228833", "#cc3311"


def plot_plan(
    path: Path,
    grids: list[tuple[str, list[int], list[int], dict]],
    caption: str,
    legend: dict,
    eager: str = "",
) -> str | bytes:
    """One grid per mode: columns are token sizes, rows LoRA cases, cells colored by state
    (`grids`: mode, sizes, cases, {(case, size): color}); `legend`: color -> meaning."""
    return _render(
        path, lambda: _grid_svg(grids, caption, legend, eager), lambda: _grid_png(grids, caption, legend, eager)
    )


def _grid_svg(grids, caption: str, legend: dict, eager: str) -> str:
    left, cell_h = 110, 16
    width = 940
    out, extra = _caption(caption, 10, 18, 12, width - 20)
    y = 40 + extra
    for mode, sizes, cases, cells in grids:
        cw = max(1.5, min(16.0, (width - left - 20) / max(len(sizes), 1)))
        out.append(f'<text x="10" y="{y + 12}" font-size="12" font-weight="bold">{mode}</text>')
        y += 20
        for r, case in enumerate(cases):
            out.append(
                f'<text x="{left - 6}" y="{y + r * cell_h + 12}" font-size="10" text-anchor="end">'
                f"LoRA case {case}</text>"
            )
            for c, size in enumerate(sizes):
                color = cells.get((case, size))
                if color:
                    out.append(
                        f'<rect x="{left + c * cw:.1f}" y="{y + r * cell_h + 1}" width="{max(cw - 1, 1):.1f}" '
                        f'height="{cell_h - 2}" fill="{color}"><title>{mode}:{size}@{case}</title></rect>'
                    )
        base = y + len(cases) * cell_h
        centers = [left + c * cw + cw / 2 for c in range(len(sizes))]
        for c in tick_labels(centers, [str(size) for size in sizes], 9):
            out.append(
                f'<text x="{centers[c]:.1f}" y="{base + 12}" font-size="9" text-anchor="middle">{sizes[c]}</text>'
            )
        out.append(f'<text x="{left}" y="{base + 26}" font-size="9">tokens (capture sizes)</text>')
        y = base + 44
    x = 10.0
    for color, meaning in legend.items():
        room = 16 + text_width(meaning, 10)
        if x > 10 and x + room > width - 10:  # the next row
            x, y = 10.0, y + 18
        out.append(f'<rect x="{x:.0f}" y="{y}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 16:.0f}" y="{y + 10}" font-size="10">{escape(meaning)}</text>')
        x += room + 14
    if eager:
        for line in wrap(eager, 10, width - 20):
            y += 18
            out.append(f'<text x="10" y="{y + 10}" font-size="10">{escape(line)}</text>')
    height = y + 24
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    return "\n".join(head + out + ["</svg>"]) + "\n"


def _grid_png(grids, caption: str, legend: dict, eager: str) -> bytes:
    plt = _pyplot()
    from matplotlib.colors import to_rgb

    if not grids:  # a plan with no graphs: the caption and what runs eager
        fig = plt.figure(figsize=(12, 1.6))
        fig.text(0.01, 0.5, caption + (f"\n{eager}" if eager else "") + "\nno graphs", fontsize=9, va="center")
        return _png_bytes(fig)
    fig, axes = plt.subplots(len(grids), 1, figsize=(12, 1.2 + 0.5 * sum(len(g[2]) for g in grids)), squeeze=False)
    for ax, (mode, sizes, cases, cells) in zip(axes[:, 0], grids):
        image = [[to_rgb(cells.get((case, size), "#ffffff")) for size in sizes] for case in cases]
        ax.imshow(image, aspect="auto", interpolation="nearest")
        ax.set_yticks(range(len(cases)), [f"case {c}" for c in cases], fontsize=8)
        step = max(1, len(sizes) // 16)
        ax.set_xticks(range(0, len(sizes), step), [sizes[i] for i in range(0, len(sizes), step)], fontsize=8)
        ax.set_title(mode, fontsize=10)
    fig.suptitle(caption + (f"\n{eager}" if eager else ""), fontsize=9)
    fig.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in legend],
        labels=list(legend.values()),
        loc="lower center",
        ncol=len(legend),
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _png_bytes(fig)
