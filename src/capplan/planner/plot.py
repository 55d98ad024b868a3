"""Plots for simulate and optimize: SVG written directly (no dependency), PNG through matplotlib."""

from __future__ import annotations

import io
from pathlib import Path
from xml.sax.saxutils import escape

from capplan.errors import UsageError
from capplan.files import check_output, write_atomic

W, H, PAD = 760, 300, 56


def _panel(title: str, xs: list[str], ys: list[float], top: int, color: str, ylabel: str) -> list[str]:
    out = [f'<text x="{PAD}" y="{top - 8}" font-size="13" font-weight="bold">{escape(title)}</text>']
    h = H - 2 * PAD
    peak = max(ys) if ys and max(ys) > 0 else 1.0
    bw = (W - 2 * PAD) / max(len(xs), 1)
    out.append(f'<line x1="{PAD}" y1="{top + h}" x2="{W - PAD}" y2="{top + h}" stroke="#333"/>')
    out.append(f'<text x="8" y="{top + 10}" font-size="10">{escape(ylabel)} (max {peak:g})</text>')
    step = max(1, len(xs) // 16)
    for i, (x, y) in enumerate(zip(xs, ys)):
        bh = h * y / peak
        out.append(
            f'<rect x="{PAD + i * bw + 1:.1f}" y="{top + h - bh:.1f}" width="{max(bw - 2, 1):.1f}" '
            f'height="{bh:.1f}" fill="{color}"><title>{escape(x)}: {y:g}</title></rect>'
        )
        if i % step == 0:
            out.append(
                f'<text x="{PAD + i * bw + bw / 2:.1f}" y="{top + h + 14}" font-size="9" '
                f'text-anchor="middle">{escape(x)}</text>'
            )
    return out


def _svg(panels: list[tuple[str, list[str], list[float], str, str]], caption: str) -> str:
    height = len(panels) * (H - PAD) + PAD
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif">',
        f'<rect width="{W}" height="{height}" fill="white"/>',
        f'<text x="{PAD}" y="18" font-size="12">{escape(caption)}</text>',
    ]
    for n, (title, xs, ys, color, ylabel) in enumerate(panels):
        body += _panel(title, xs, ys, 44 + n * (H - PAD), color, ylabel)
    body.append("</svg>")
    return "\n".join(body) + "\n"


def _png(panels: list[tuple[str, list[str], list[float], str, str]], caption: str) -> bytes:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("PNG plots need matplotlib", "pip install matplotlib, or give a .svg path") from None
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (title, xs, ys, color, ylabel) in zip(axes[:, 0], panels):
        ax.bar(range(len(xs)), ys, color=color)
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


def write_plot(
    path: Path, panels: list[tuple[str, list[str], list[float], str, str]], caption: str, inputs: tuple[Path, ...] = ()
) -> None:
    suffix = path.suffix.lower()
    if suffix == ".svg":
        write_atomic(path, _svg(panels, caption), inputs)
    elif suffix == ".png":
        check_output(path, inputs)
        write_atomic(path, _png(panels, caption), inputs)
    else:
        raise UsageError(f"--plot {path}: unknown image type {suffix or '(none)'!r}", "use a .svg or .png path")


def simulation_panels(data: dict) -> list[tuple[str, list[str], list[float], str, str]]:
    sizes = [str(r["num_tokens"]) for r in data["by_size"]]
    return [
        ("steps replayed per captured size", sizes, [r["steps"] for r in data["by_size"]], "#4477aa", "steps"),
        (
            "padded tokens per captured size",
            sizes,
            [r["padded_tokens"] for r in data["by_size"]],
            "#cc6677",
            "padded tokens",
        ),
    ]


def curve_panels(points: list) -> list[tuple[str, list[str], list[float], str, str]]:
    xs = [str(p.graphs) for p in points]
    return [
        (
            "padding overhead (%) vs graphs captured",
            xs,
            [round(100 * p.padding_overhead, 3) for p in points],
            "#228833",
            "padding %",
        )
    ]
