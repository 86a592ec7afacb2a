"""A small line chart as a PNG, with numpy, zlib and struct only (no plotting library): ``sweep``'s plot.

``chart(panels, xs)`` draws panels stacked top to bottom over one shared x axis; each panel is a list of
``Series`` (values per x, one colour each; drawn in x order) with its own y range (``ylim``, or the data's, padded). Per panel: a
left and a bottom axis, tick marks at each x (up to ``MAX_X_TICKS``, else evenly spaced) and at the y range's ends
and middle, labelled with 5x7 bitmap digits; one polyline per series with a square marker at each point; a
missing value (NaN, inf) breaks the line. Larger y is drawn higher. ``png_bytes(rgb)`` encodes an
``[H, W, 3]`` uint8 image (8-bit RGB, no interlace, filter 0 on every row) with each chunk's CRC-32.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_X_TICKS = 12
WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (200, 200, 200)
# 5x7 glyphs, one string of 7 rows per character ("1": pixel set)
_GLYPHS = {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    "-": "00000 00000 00000 11111 00000 00000 00000", ".": "00000 00000 00000 00000 00000 01100 01100",
    "e": "00000 00000 01110 10001 11111 10000 01110", "+": "00000 00100 00100 11111 00100 00100 00000",
}
GLYPH_W, GLYPH_H = 5, 7
LEFT, RIGHT, TOP, BOTTOM, GAP = 56, 16, 12, 24, 18  # margins (pixels): tick labels left and below


@dataclass
class Series:
    values: Sequence[float]  # one per x; NaN: no point
    color: tuple[int, int, int]


def png_bytes(rgb: np.ndarray) -> bytes:
    """An ``[H, W, 3]`` uint8 image as PNG bytes."""
    img = np.ascontiguousarray(rgb, dtype=np.uint8)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"expected an [H, W, 3] image, got shape {img.shape}")
    h, w, _ = img.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, w * 3)], axis=1)  # filter byte 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit, truecolour, deflate, filter 0, no interlace
    return SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9)) + chunk(b"IEND", b"")


def _label(v: float) -> str:
    text = f"{v:.3g}"
    return text if all(c in _GLYPHS for c in text) else ""


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.img = np.full((height, width, 3), WHITE, np.uint8)

    def dot(self, rows: np.ndarray, cols: np.ndarray, color: tuple[int, int, int]) -> None:
        h, w, _ = self.img.shape
        keep = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
        self.img[rows[keep], cols[keep]] = color

    def line(self, r0: float, c0: float, r1: float, c1: float, color: tuple[int, int, int], width: int = 1) -> None:
        n = int(max(abs(r1 - r0), abs(c1 - c0))) + 1
        rows, cols = np.rint(np.linspace(r0, r1, n)).astype(int), np.rint(np.linspace(c0, c1, n)).astype(int)
        for d in range(width):  # thicker lines: the same path one row lower
            self.dot(rows + d, cols, color)

    def box(self, r: float, c: float, half: int, color: tuple[int, int, int]) -> None:
        rr, cc = np.mgrid[-half:half + 1, -half:half + 1]
        self.dot((rr + round(r)).ravel(), (cc + round(c)).ravel(), color)

    def text(self, s: str, r: int, c: int) -> None:
        """``s`` with its top-left corner at (r, c)."""
        for i, ch in enumerate(s):
            bits = np.array([[b == "1" for b in row] for row in _GLYPHS[ch].split()])
            rows, cols = np.nonzero(bits)
            self.dot(rows + r, cols + c + i * (GLYPH_W + 1), BLACK)


def _ylim(panel: Sequence[Series], ylim: tuple[float, float] | None) -> tuple[float, float]:
    if ylim is not None:
        return ylim
    vals = np.asarray([v for s in panel for v in s.values], np.float64)
    vals = vals[np.isfinite(vals)]
    if not vals.size:
        return 0.0, 1.0
    lo, hi = float(vals.min()), float(vals.max())
    pad = (hi - lo) * 0.08 if hi > lo else max(abs(lo) * 0.1, 0.5)
    return lo - pad, hi + pad


def chart(panels: Sequence[Sequence[Series]], xs: Sequence[float], *, ylims: Sequence[tuple[float, float] | None]
          | None = None, width: int = 640, panel_height: int = 220) -> np.ndarray:
    """The chart as an ``[H, W, 3]`` uint8 image (see the module docstring)."""
    x = np.asarray(xs, np.float64)
    if not len(panels) or not x.size or not np.isfinite(x).all():
        raise ValueError("a chart needs at least one panel and finite x values")
    order = np.argsort(x, kind="stable")
    x = x[order]
    ylims = list(ylims) if ylims is not None else [None] * len(panels)
    height = TOP + len(panels) * panel_height + (len(panels) - 1) * GAP + BOTTOM
    cv = _Canvas(width, height)
    x0, x1 = float(x.min()), float(x.max())
    if x1 == x0:
        x0, x1 = x0 - 1.0, x1 + 1.0
    left, right = LEFT, width - RIGHT - 1
    col = lambda v: left + (v - x0) / (x1 - x0) * (right - left)  # noqa: E731
    ticks = np.unique(x) if np.unique(x).size <= MAX_X_TICKS else np.linspace(x0, x1, 5)
    for p, panel in enumerate(panels):
        top = TOP + p * (panel_height + GAP)
        bottom = top + panel_height - 1
        lo, hi = _ylim(panel, ylims[p])
        row = lambda v: bottom - (v - lo) / (hi - lo) * (bottom - top)  # noqa: E731
        cv.line(top, left, bottom, left, BLACK)  # y axis
        cv.line(bottom, left, bottom, right, BLACK)  # x axis
        for t in ticks:
            cv.line(bottom + 1, col(t), bottom + 4, col(t), BLACK)
            if p == len(panels) - 1 and (s := _label(float(t))):
                cv.text(s, bottom + 7, int(round(col(t) - len(s) * (GLYPH_W + 1) / 2)))
        for v in (lo, (lo + hi) / 2, hi):
            r = row(v)
            cv.line(r, left - 4, r, left - 1, BLACK)
            if s := _label(v):
                cv.text(s, int(round(r - GLYPH_H / 2)), max(0, left - 6 - len(s) * (GLYPH_W + 1)))
        for series in panel:
            y = np.asarray(series.values, np.float64)
            if y.shape != x.shape:
                raise ValueError(f"a series has {y.size} values for {x.size} x values")
            y = y[order]
            ok = np.isfinite(y)
            for i in range(x.size - 1):
                if ok[i] and ok[i + 1]:
                    cv.line(row(y[i]), col(x[i]), row(y[i + 1]), col(x[i + 1]), series.color, width=2)
            for i in np.flatnonzero(ok):
                cv.box(row(y[i]), col(x[i]), 2, series.color)
    return cv.img
