"""The 32-weight block formats (Q4_0, Q4_1, Q5_0, Q8_0) as tiles of 8 output columns (csrc/qgemm.c, the comment
above ``passt32``): the same bytes per weight, laid out so that one 32-byte load holds 4 consecutive weights of
each of the 8 columns (byte 4 c + e: weight 4 g + e of column c), which one vpdpbusd (AVX2: vpmaddubsw)
multiplies by 4 broadcast activation bytes, each column's sum in its own lane.

Per tile of 8 columns and block of 32 weights, ``8 * bytes per block`` bytes:

- Q4_0 (144): ``d[8]`` float16 | 128 bytes of nibbles
- Q4_1 (160): ``d[8]`` | ``m[8]`` float16 | 128 bytes of nibbles
- Q5_0 (176): ``d[8]`` | 32 bytes of fifth bits | 128 bytes of nibbles
- Q8_0 (272): ``d[8]`` | 256 bytes ``q + 128`` (unsigned): vector g < 8, byte 4 c + e = weight 4 g + e of column c

Nibbles: vector h < 4, byte 4 c + e: weight 4 h + e of column c (low nibble), weight 4 (h + 4) + e (high
nibble). Fifth bits (Q5_0): byte 4 c + e, bit g: the fifth bit of weight 4 g + e of column c. The values u
(w = d u - 8 d, d u + m, d u - 16 d, d (u - 128)) are GGUF's: only where their bytes sit changes.
"""

from __future__ import annotations

import numpy as np

#: columns per tile
TILE = 8
#: format -> (bytes per block, bytes of float16 fields before the weights: d, and Q4_1's m)
_LAYOUT = {"Q4_0": (18, 2), "Q4_1": (20, 4), "Q5_0": (22, 2), "Q8_0": (34, 2)}


def _values(b: np.ndarray, kind: str) -> np.ndarray:
    """GGUF blocks [..., bytes] uint8 -> the 32 unsigned values u [..., 32] uint8 (Q8_0: q + 128)."""
    if kind == "Q8_0":
        return b[..., 2:34] ^ np.uint8(0x80)
    qs = b[..., -16:]
    u = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if kind == "Q5_0":
        qh = b[..., 2:6].copy().view("<u4")  # [..., 1] little-endian: bit j = fifth bit of weight j
        u |= (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    return u


def _blocks(u: np.ndarray, head: np.ndarray, kind: str) -> np.ndarray:
    """The inverse of :func:`_values`: u [..., 32] and the float16 fields [..., 2 or 4] -> GGUF blocks."""
    out = np.empty(u.shape[:-1] + (_LAYOUT[kind][0],), np.uint8)
    out[..., : head.shape[-1]] = head
    if kind == "Q8_0":
        out[..., 2:34] = u ^ np.uint8(0x80)
        return out
    out[..., -16:] = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)
    if kind == "Q5_0":
        bits = (u >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)
        out[..., 2:6] = np.bitwise_or.reduce(bits, axis=-1, keepdims=True).astype("<u4").view(np.uint8)
    return out


def tile(raw: np.ndarray, kind: str) -> np.ndarray:
    """GGUF rows [8 T, nb * bytes] uint8 -> tiles of 8 columns [8 T, nb * bytes] uint8 (the module docstring)."""
    nbytes, nhead = _LAYOUT[kind]
    n, nb = raw.shape[0], raw.shape[1] // nbytes
    t = n // TILE
    b = raw.reshape(t, TILE, nb, nbytes).transpose(0, 2, 1, 3)  # [tile, block, column, byte]
    out = np.empty((t, nb, TILE * nbytes), np.uint8)
    for f in range(0, nhead, 2):  # d, then m: each as 8 float16
        out[..., 8 * f : 8 * f + 16] = b[..., f : f + 2].reshape(t, nb, 16)
    at = 8 * nhead
    u = _values(b, kind).reshape(t, nb, TILE, 8, 4).transpose(0, 1, 3, 2, 4)  # [.., g, column, e]
    if kind == "Q8_0":
        out[..., at:] = u.reshape(t, nb, 256)
        return out.reshape(n, nb * nbytes)
    if kind == "Q5_0":
        out[..., at : at + 32] = np.bitwise_or.reduce((u >> 4) << np.arange(8, dtype=np.uint8)[:, None, None],
                                                      axis=2).reshape(t, nb, 32)
        at += 32
    lo = u & 15
    out[..., at:] = (lo[:, :, 0:4] | (lo[:, :, 4:8] << 4)).reshape(t, nb, 128)
    return out.reshape(n, nb * nbytes)


def untile(packed: np.ndarray, kind: str) -> np.ndarray:
    """The inverse of :func:`tile`: [8 T, nb * bytes] uint8 tiles -> GGUF rows [8 T, nb * bytes] uint8."""
    nbytes, nhead = _LAYOUT[kind]
    n, nb = packed.shape[0], packed.shape[1] // nbytes
    t = n // TILE
    p = packed.reshape(t, nb, TILE * nbytes)
    head = np.concatenate([p[..., 8 * f : 8 * f + 16].reshape(t, nb, TILE, 2) for f in range(0, nhead, 2)], axis=-1)
    at = 8 * nhead
    if kind == "Q8_0":
        u = p[..., at:].reshape(t, nb, 8, TILE, 4)
    else:
        hb = np.zeros((t, nb, 8, TILE, 4), np.uint8)
        if kind == "Q5_0":
            bits = p[..., at : at + 32].reshape(t, nb, 1, TILE, 4)
            hb = ((bits >> np.arange(8, dtype=np.uint8)[:, None, None]) & 1) << 4
            at += 32
        q = p[..., at:].reshape(t, nb, 4, TILE, 4)
        u = np.concatenate([q & 15, q >> 4], axis=2) | hb  # [.., g, column, e]
    u = u.transpose(0, 1, 3, 2, 4).reshape(t, nb, TILE, 32)
    b = _blocks(u, head, kind)  # [tile, block, column, byte]
    return np.ascontiguousarray(b.transpose(0, 2, 1, 3)).reshape(n, nb * nbytes)
