"""Draws docs/img/views.png from flatview.layout: how a flat parameter's original
parameters fall on ranks as full, partial and empty views.

Run: python docs/make_figures.py  (needs matplotlib)
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from flatview.layout import FlatLayout, PieceKind

PARAMS = [("fc.weight", (4, 3)), ("fc.bias", (4,)), ("ln.w", (3,)), ("out.weight", (2, 3))]
WORLD = 3
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
HATCH = {PieceKind.FULL: "", PieceKind.PARTIAL: "//", PieceKind.EMPTY: ""}


def main() -> None:
    layout = FlatLayout.packed([shape for _, shape in PARAMS], WORLD)
    fig, ax = plt.subplots(figsize=(10, 3.6))
    scale = 10 / layout.padded_numel
    # Top row: the unsharded flat parameter with its segments and the padding.
    y = WORLD + 0.6
    for (name, _), segment, color in zip(PARAMS, layout.segments, COLORS, strict=True):
        ax.add_patch(
            Rectangle((segment.offset * scale, y), segment.numel * scale, 0.6, color=color)
        )
        ax.text(
            (segment.offset + segment.numel / 2) * scale,
            y + 0.3,
            name,
            ha="center",
            va="center",
            fontsize=8,
            color="white",
        )
    pad = layout.padded_numel - layout.numel
    ax.add_patch(Rectangle((layout.numel * scale, y), pad * scale, 0.6, fill=False, hatch="xx"))
    ax.text(-0.2, y + 0.3, "flat parameter", ha="right", va="center", fontsize=9)
    # One row per rank: its shard, and each parameter's piece in it.
    for rank in range(WORLD):
        y = WORLD - 1 - rank
        start, end = layout.shard_interval(rank)
        ax.add_patch(Rectangle((start * scale, y), (end - start) * scale, 0.6, fill=False, lw=1.5))
        kinds = []
        for piece, color, (name, _) in zip(layout.pieces(rank), COLORS, PARAMS, strict=True):
            if piece.kind is PieceKind.EMPTY:
                kinds.append(f"{name}: empty")
                continue
            x = (start + piece.shard_offset) * scale
            ax.add_patch(
                Rectangle(
                    (x, y),
                    piece.numel * scale,
                    0.6,
                    facecolor=color,
                    hatch=HATCH[piece.kind],
                    edgecolor="white",
                    lw=0.5,
                )
            )
            kinds.append(f"{name}: {piece.kind.value}")
        ax.text(-0.2, y + 0.3, f"rank {rank} shard", ha="right", va="center", fontsize=9)
        ax.text(10.2, y + 0.3, ", ".join(kinds), ha="left", va="center", fontsize=7)
    ax.set_xlim(-2.2, 17)
    ax.set_ylim(-0.3, WORLD + 1.4)
    ax.axis("off")
    ax.set_title(
        f"{layout.numel} elements, {WORLD} ranks: shards of {layout.shard_numel}, "
        f"{pad} padding (hatched pieces are partial views)",
        fontsize=9,
    )
    out = Path(__file__).parent / "img" / "views.png"
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
