"""A minimal PNG reader (8-bit RGB/RGBA, not interlaced): enough to count the colours of a browser screenshot.

zlib and struct only, with numpy for the row filters that vectorise (None, Sub, Up); Average and Paeth run
per byte in Python, which for a 1280x900 screenshot takes well under a second.
"""

from __future__ import annotations

import struct
import zlib
from collections import Counter

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png(data: bytes) -> np.ndarray:
    """The image as a (height, width, channels) uint8 array."""
    if data[:8] != _SIGNATURE:
        raise ValueError("not a PNG file")
    pos, idat, header = 8, [], None
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if header is None:
        raise ValueError("PNG without IHDR")
    width, height, depth, color, _, _, interlace = header
    channels = {2: 3, 6: 4}.get(color)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"unsupported PNG (bit depth {depth}, colour type {color}, interlace {interlace})")
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8)
    stride = width * channels
    rows = raw.reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        f, line = rows[y, 0], rows[y, 1:]
        if f == 0:
            cur = line.copy()
        elif f == 1:  # Sub: a running sum per channel
            cur = (np.cumsum(line.reshape(width, channels), axis=0, dtype=np.uint64) % 256).astype(np.uint8).ravel()
        elif f == 2:  # Up
            cur = line + prev
        elif f in (3, 4):
            cur = _sequential(f, line.tolist(), prev.tolist(), channels)
        else:
            raise ValueError(f"bad PNG filter type {f} in row {y}")
        out[y] = cur
        prev = out[y]
    return out.reshape(height, width, channels)


def _sequential(f: int, line: list[int], prev: list[int], bpp: int) -> np.ndarray:
    cur = [0] * len(line)
    for i, x in enumerate(line):
        a = cur[i - bpp] if i >= bpp else 0
        b = prev[i]
        if f == 3:
            cur[i] = (x + ((a + b) >> 1)) & 0xFF
        else:
            c = prev[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            cur[i] = (x + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return np.array(cur, dtype=np.uint8)


def colour_counts(image: np.ndarray) -> Counter:
    """How many pixels have each exact RGB colour, keyed by "#rrggbb"."""
    rgb = image[..., :3].reshape(-1, 3).astype(np.uint32)
    packed = (rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]
    values, counts = np.unique(packed, return_counts=True)
    return Counter({f"#{v:06x}": int(c) for v, c in zip(values, counts)})
