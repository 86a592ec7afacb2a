"""``extract.png_chart`` (sweep's plot without a plotting library): the bytes are a valid PNG (signature, IHDR,
every chunk's CRC, an IDAT that inflates to filter-0 rows of the declared size), read back independently here, and
the polylines sit where the data says: a rising series climbs (its rows fall as x grows), a missing value breaks
the line, each panel keeps its own range, and x is drawn in order whatever order it is given in."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from vllm_steer.extract.png_chart import SIGNATURE, Series, chart, png_bytes

RED, BLUE = (220, 20, 20), (20, 20, 220)


def read_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB, non-interlaced, filter-0 PNG back to [H, W, 3], checking every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" == SIGNATURE
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data) and [k for k, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    w, h, depth, ctype, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    rows = np.frombuffer(raw, np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()  # filter type 0 (None) on every row
    return rows[:, 1:].reshape(h, w, 3)


def mask(img: np.ndarray, color: tuple) -> np.ndarray:
    return (img == np.asarray(color, np.uint8)).all(axis=2)


def test_encoded_image_reads_back_exactly():
    img = np.random.default_rng(0).integers(0, 256, (7, 11, 3), dtype=np.uint8)
    assert np.array_equal(read_png(png_bytes(img)), img)
    with pytest.raises(ValueError, match="expected an"):
        png_bytes(np.zeros((4, 4), np.uint8))


def test_a_rising_series_climbs_and_a_falling_one_descends():
    xs = [0.0, 0.1, 0.2, 0.4, 0.8]
    img = read_png(png_bytes(chart([[Series([-3.0, -2.5, -2.0, -1.0, 0.5], RED),
                                      Series([0.5, 0.0, -1.0, -2.0, -3.0], BLUE)]], xs)))
    assert img.shape == (12 + 220 + 24, 640, 3)
    for color, sign in ((RED, -1), (BLUE, 1)):
        m = mask(img, color)
        cols = np.flatnonzero(m.any(axis=0))
        assert cols.size > 400  # one line across the plot area
        mean_row = np.array([np.flatnonzero(m[:, c]).mean() for c in cols])
        steps = np.diff(mean_row[::20])
        assert (sign * steps > 0).all(), (color, mean_row[::20])  # rows fall (red climbs) / rise (blue descends)
    # both series meet the same extremes: the top and bottom of the padded range
    red_rows = np.flatnonzero(mask(img, RED).any(axis=1))
    blue_rows = np.flatnonzero(mask(img, BLUE).any(axis=1))
    assert abs(red_rows.min() - blue_rows.min()) <= 1 and abs(red_rows.max() - blue_rows.max()) <= 1
    # axes and tick labels (black) are drawn left of and below the plot
    black = mask(img, (0, 0, 0))
    assert black[:, 56].sum() >= 200 and black[12 + 219, 56:620].all()


def test_a_missing_value_breaks_the_line_and_panels_keep_their_own_ranges():
    xs = [0.0, 1.0, 2.0, 3.0]
    img = read_png(png_bytes(chart([[Series([1.0, 2.0, float("nan"), 4.0], RED)],
                                    [Series([100.0, 100.0, 100.0, 100.0], BLUE)]], xs, ylims=[None, (0.0, 200.0)])))
    red = mask(img, RED)
    cols = np.flatnonzero(red.any(axis=0))
    left, right = 56, 640 - 16 - 1
    x_col = [left + x / 3.0 * (right - left) for x in xs]
    gap = [c for c in range(int(x_col[1]) + 4, int(x_col[3]) - 3)]  # past point 1's marker, before point 3's
    assert not red[:, gap].any() and red[:, int(x_col[3])].any()
    assert cols.min() >= left - 3 and cols.max() <= right + 3
    # the second panel (below the first) holds the blue line, flat in the middle of 0..200
    blue_rows = np.flatnonzero(mask(img, BLUE).any(axis=1))
    top2 = 12 + 220 + 18
    assert blue_rows.min() > 12 + 220 and abs(np.median(blue_rows) - (top2 + 219 / 2)) <= 3
    assert not mask(img, BLUE)[: 12 + 220].any() and not red[top2:].any()


def test_x_is_drawn_in_order():
    ys, xs = [3.0, 1.0, 2.0], [0.2, 0.0, 0.1]  # y rises with x once sorted
    img = read_png(png_bytes(chart([[Series(ys, RED)]], xs)))
    m = mask(img, RED)
    cols = np.flatnonzero(m.any(axis=0))
    mean_row = np.array([np.flatnonzero(m[:, c]).mean() for c in cols])
    assert (np.diff(mean_row[::25]) < 0).all()
    with pytest.raises(ValueError, match="2 values for 3"):
        chart([[Series([1.0, 2.0], RED)]], xs)
