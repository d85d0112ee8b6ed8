"""GGUF quantized weights as linear_gguf runs them (kestrel/ops/csrc/linear_gguf.cpp; layouts: gguf_blocks.h).

A GGUF file stores a matrix [N, K] as rows of blocks along K. Eight of llama.cpp's block types are kept
as the file stores them, in `GGUF_FORMATS`:
- Q8_0: 32 int8 q and a float16 scale d; values q * d.
- Q4_1: 32 4-bit q, a float16 scale d and min m; values d * q + m. Q4_0: the same without m, values
  d * (q - 8). Both pack as one kernel format, d and an offset per block (-m, or 8 d: exact in float32),
  values d * q - offset.
- Q6_K: super-blocks of 256 in 16 blocks of 16: 6-bit q, an int8 scale per block and a float16 d;
  values (d * scale) * (q - 32).
- Q4_K: super-blocks of 256 in 8 blocks of 32: 4-bit q, 6-bit scales and mins, float16 d and dmin;
  values (d * scale) * q - dmin * min.
- Q5_1: 32 5-bit q (4 low bits, and the fifth in a 32-bit word), float16 d and m; values d * q + m.
  It packs as Q5: Q4_1's block with each q's fifth bit beside its nibbles, values d * q - offset (-m).
- Q5_K: Q4_K's super-blocks with 5-bit q; values (d * scale) * q - dmin * min. It packs as Q4_K's
  super-block with its q in Q6_K's byte lanes (nibbles, then the fifth bits). Q5_0 (values d * (q -
  16)) packs as Q8_0, its q - 16 as the int8.
These are the float32 operations and order of gguf.quants (and of llama.cpp's dequantization), so the
values here are its bits; the kernel computes the same ones.

`pack_gguf_weight` puts a weight (one part or several, each of its own type, stacked along N: a fused
projection whose parts the file stores in different types) into linear_gguf's layout: a header of
int64 (K, N, the number of segments, then each segment's format code, rows and byte offset), then the
segments, each 16 rows (a panel) at a time along its blocks (see csrc/gguf_blocks.h for the bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GGUF_PANEL = 16        # the rows of a weight that one packed block holds
_ALIGN = 64            # each segment starts on a cache line
_SCALES = GGUF_PANEL * 4   # a panel's float32 per column


@dataclass(frozen=True)
class GGUFFormat:
    """A GGUF block type that linear_gguf runs from its blocks."""
    name: str            # gguf.GGMLQuantizationType's name
    code: int            # csrc/gguf_blocks.h's GgufFormat
    file_block: int      # values per file block along K (K is a multiple of it)
    file_block_bytes: int
    block: int           # values per packed block along K (Q4_K, Q6_K: a super-block of 256)
    packed_bytes: int    # packed bytes per panel and block
    # file rows [n, K / file_block * file_block_bytes] (uint8; n a multiple of 16) -> [n / 16, K / block, packed_bytes]
    pack: Callable[[torch.Tensor], torch.Tensor]
    # packed panels [n, K / block, packed_bytes] and a column in each -> float32 [n, K], that column's values
    values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def row_bytes(self, k: int) -> int:
        return k // self.file_block * self.file_block_bytes


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Each block's float16 at byte `at`, widened: [..., blocks]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[n, blocks, *rest] -> [n / 16, blocks, *rest, 16]: each panel's 16 rows innermost."""
    n, blocks = t.shape[:2]
    t = t.reshape(n // GGUF_PANEL, GGUF_PANEL, blocks, -1)
    return t.permute(0, 2, 3, 1).contiguous()


def _pack_int8(scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float32 scales [n, blocks] and int8 q [n, blocks, B] as the int8 layout: per panel and block, the
    16 scales, then B k-rows of 16 int8."""
    p, nb = scales.shape[0] // GGUF_PANEL, scales.shape[1]
    packed = torch.empty(p, nb, _SCALES + q.shape[2] * GGUF_PANEL, dtype=torch.uint8)
    packed[..., :_SCALES] = _panels(scales.contiguous()).reshape(p, nb, GGUF_PANEL).view(torch.uint8)
    packed[..., _SCALES:] = _panels(q.view(torch.uint8)).reshape(p, nb, -1)
    return packed


def _column(packed: torch.Tensor, column: torch.Tensor, at: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """From each panel [n, blocks, bytes], its column's `count` values of `dtype` stored 16 to a row
    from byte `at`: [n, blocks, count]."""
    n, nb = packed.shape[:2]
    width = torch.empty((), dtype=dtype).element_size()
    rows = packed[..., at:at + count * GGUF_PANEL * width].contiguous().view(dtype).view(n, nb, count, GGUF_PANEL)
    return rows.gather(3, column.view(n, 1, 1, 1).expand(n, nb, count, 1)).squeeze(3)


def _int8_values(packed: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    n, nb = packed.shape[:2]
    block = (packed.shape[2] - _SCALES) // GGUF_PANEL
    scales = _column(packed, column, 0, 1, torch.float32)
    return (_column(packed, column, _SCALES, block, torch.int8).float() * scales).view(n, -1)


# ---- Q8_0: d f16, 32 int8 q ----

def _pack_q8_0(rows: torch.Tensor) -> torch.Tensor:
    b = rows.reshape(rows.shape[0], -1, 34)
    return _pack_int8(_f16(b, 0), b[..., 2:].contiguous().view(torch.int8))


# ---- Q6_K: ql [128], qh [64], int8 scales [16], d f16 ----

def _q6_k_quants(b: torch.Tensor) -> torch.Tensor:
    """A super-block's 256 q - 32 as int8 [..., 16 blocks, 16] (gguf.quants' order)."""
    lead = b.shape[:-1]
    shifts = torch.tensor([0, 4], dtype=torch.uint8)
    ql = (b[..., :128].reshape(*lead, 2, 1, 64) >> shifts.view(2, 1)) & 0x0F          # [.., 2, 2, 64]
    qh = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    q = ql.reshape(*lead, 2, 128) | (qh.reshape(*lead, 2, 128) << 4)
    return (q.view(torch.int8) - 32).reshape(*lead, 16, 16)


# Per panel and super-block: d (float32, 64 bytes), the 16 blocks' int8 scales (16 x 16 bytes), then each
# block of 16's q (0 .. 63; values d sc (q - 32)) in 3 runs of 64 bytes, byte 4c + t of each holding column
# c's k-row t of a group of 4 k-rows: the low 4 bits of groups 0 (low nibble) and 1 (high nibble), of
# groups 2 and 3, then the high 2 bits of groups 0 .. 3 (bits 0-1, 2-3, 4-5, 6-7). 0.83 bytes a weight.
_Q6_K_QUANTS = _SCALES + 16 * GGUF_PANEL
_Q6_K_BYTES = _Q6_K_QUANTS + 16 * 3 * 4 * GGUF_PANEL


def _pack_q6_k(rows: torch.Tensor) -> torch.Tensor:
    n = rows.shape[0]
    b = rows.reshape(n, -1, 210)
    nb = b.shape[1]
    q = (_q6_k_quants(b) + 32).view(torch.uint8).reshape(n, nb, 16, 4, 4)   # [.., block, group g, t]
    low, high = q & 0x0F, q >> 4
    runs = torch.stack([low[..., 0, :] | (low[..., 1, :] << 4), low[..., 2, :] | (low[..., 3, :] << 4),
                        high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)],
                       dim=3)                                                # [n, nb, 16, 3, 4 (t)]
    packed = torch.empty(n // GGUF_PANEL, nb, _Q6_K_BYTES, dtype=torch.uint8)
    packed[..., :_SCALES] = _panels(_f16(b, 208).unsqueeze(-1)).reshape(-1, nb, GGUF_PANEL).view(torch.uint8)
    packed[..., _SCALES:_Q6_K_QUANTS] = _panels(b[..., 192:208]).reshape(-1, nb, 16 * GGUF_PANEL)
    by_column = _panels(runs).view(-1, nb, 16, 3, 4, GGUF_PANEL).transpose(-1, -2)   # [.., block, run, c, t]
    packed[..., _Q6_K_QUANTS:] = by_column.reshape(-1, nb, 16 * 3 * 4 * GGUF_PANEL)
    return packed


def _q6_k_values(packed: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    n, nb = packed.shape[:2]
    scale = _column(packed, column, 0, 1, torch.float32) * _column(packed, column, _SCALES, 16, torch.int8).float()
    runs = packed[..., _Q6_K_QUANTS:].reshape(n, nb, 16, 3, GGUF_PANEL, 4)
    runs = runs.gather(4, column.view(n, 1, 1, 1, 1, 1).expand(n, nb, 16, 3, 1, 4)).squeeze(4)   # [n, nb, 16, 3, t]
    nibbles = runs[..., :2, :]
    low = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=4).flatten(3, 4)          # [n, nb, 16, 4 (g), t]
    high = (runs[..., 2:3, :] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3   # [n, nb, 16, 4, t]
    q = (low | (high << 4)).view(torch.int8) - 32
    return (scale.unsqueeze(-1) * q.reshape(n, nb, 16, 16).float()).view(n, -1)


# ---- Q4_K: d f16, dmin f16, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit q ----

# Per panel and super-block: d and dmin (float32, 64 bytes each), the 8 scales and 8 mins (128 bytes
# each), then 64 groups of 4 k-rows, 32 bytes each: byte 2c + t holds column c's q of k-row 4g + t (low
# nibble) and of 4g + 2 + t (high nibble).
_Q4_K_SCALES = 2 * _SCALES
_Q4_K_MINS = _Q4_K_SCALES + 8 * GGUF_PANEL
_Q4_K_QUANTS = _Q4_K_MINS + 8 * GGUF_PANEL


def _q4_k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of each super-block [..., 12] as uint8 [..., 8] (gguf.quants' Q4_K)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def _super_block_header(b: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Panels [n / 16, nb, nbytes] of Q4_K's (or Q5_K's) super-blocks b [n, nb, bytes] with their d, dmin,
    scales and mins in place (the q's bytes from _Q4_K_QUANTS on are left to the caller)."""
    n, nb = b.shape[:2]
    scales, mins = _q4_k_scales_mins(b[..., 4:16])                       # [n, nb, 8]
    packed = torch.empty(n // GGUF_PANEL, nb, nbytes, dtype=torch.uint8)
    packed[..., :_SCALES] = _panels(_f16(b, 0).unsqueeze(-1)).reshape(-1, nb, GGUF_PANEL).view(torch.uint8)
    packed[..., _SCALES:2 * _SCALES] = _panels(_f16(b, 2).unsqueeze(-1)).reshape(-1, nb, GGUF_PANEL).view(torch.uint8)
    packed[..., _Q4_K_SCALES:_Q4_K_MINS] = _panels(scales).reshape(-1, nb, 8 * GGUF_PANEL)
    packed[..., _Q4_K_MINS:_Q4_K_QUANTS] = _panels(mins).reshape(-1, nb, 8 * GGUF_PANEL)
    return packed


def _pack_q4_k(rows: torch.Tensor) -> torch.Tensor:
    n = rows.shape[0]
    b = rows.reshape(n, -1, 144)
    nb = b.shape[1]
    # 4 runs of 32 bytes: the low nibbles are values 64j..64j+31, the high ones the next 32.
    qs = b[..., 16:].reshape(n, nb, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    q = (qs & 0x0F).reshape(n, nb, 64, 2, 2)          # [.., group g, half h, t]: k-row 4g + 2h + t
    nibbles = q[..., 0, :] | (q[..., 1, :] << 4)       # [n, nb, 64, 2 (t)]
    packed = _super_block_header(b, _Q4_K_QUANTS + 128 * GGUF_PANEL)
    by_group = _panels(nibbles).view(-1, nb, 64, 2, GGUF_PANEL).transpose(-1, -2)   # [.., g, c, t]
    packed[..., _Q4_K_QUANTS:] = by_group.reshape(-1, nb, 128 * GGUF_PANEL)
    return packed


def _column_pairs(packed: torch.Tensor, column: torch.Tensor, at: int) -> torch.Tensor:
    """The 4-bit quants of each panel's column (Q4_K's, Q4_1's): its 2 bytes in each group of 32 from `at`."""
    n, nb = packed.shape[:2]
    count = (packed.shape[2] - at) // (2 * GGUF_PANEL)
    groups = packed[..., at:].reshape(n, nb, count, GGUF_PANEL, 2)
    return groups.gather(3, column.view(n, 1, 1, 1, 1).expand(n, nb, count, 1, 2)).squeeze(3)


def _super_block_scales(packed: torch.Tensor, column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sub-block's d * scale and dmin * min of a column of Q4_K's (and Q5_K's) panels: [n, nb, 8] each."""
    d = _column(packed, column, 0, 1, torch.float32)
    dmin = _column(packed, column, _SCALES, 1, torch.float32)
    return (d * _column(packed, column, _Q4_K_SCALES, 8, torch.uint8).float(),
            dmin * _column(packed, column, _Q4_K_MINS, 8, torch.uint8).float())


def _q4_k_values(packed: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    n, nb = packed.shape[:2]
    scale, low = _super_block_scales(packed, column)
    groups = _column_pairs(packed, column, _Q4_K_QUANTS)               # [n, nb, 64, 2 (t)]
    q = torch.stack([groups & 0x0F, groups >> 4], dim=-2).reshape(n, nb, 8, 32).float()
    return (scale.unsqueeze(-1) * q - low.unsqueeze(-1)).view(n, -1)


# ---- Q4_1: d f16, m f16, 16 bytes of 4-bit q; Q4_0: d f16, 16 bytes (q - 8) ----

# Per panel and block of 32: d and the offset (float32, 64 bytes each), then 8 groups of 4 k-rows as
# Q4_K's (byte 2c + t: column c's q of k-row 4g + t in the low nibble, of 4g + 2 + t in the high one).
_Q4_1_QUANTS = 2 * _SCALES


def _pack_q4(d: torch.Tensor, offset: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """float32 d and offset [n, nb] and the file's 16 bytes of q per block [n, nb, 16] (value i in byte
    i's low nibble, value 16 + i in its high one) as the Q4_1 layout."""
    n, nb = d.shape
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, nb, 8, 2, 2)   # [.., group g, half h, t]
    nibbles = q[..., 0, :] | (q[..., 1, :] << 4)                            # [n, nb, 8, 2 (t)]
    packed = torch.empty(n // GGUF_PANEL, nb, _Q4_1_QUANTS + 16 * GGUF_PANEL, dtype=torch.uint8)
    packed[..., :_SCALES] = _panels(d.unsqueeze(-1)).reshape(-1, nb, GGUF_PANEL).view(torch.uint8)
    packed[..., _SCALES:_Q4_1_QUANTS] = _panels(offset.unsqueeze(-1)).reshape(-1, nb, GGUF_PANEL).view(torch.uint8)
    by_group = _panels(nibbles).view(-1, nb, 8, 2, GGUF_PANEL).transpose(-1, -2)   # [.., g, c, t]
    packed[..., _Q4_1_QUANTS:] = by_group.reshape(-1, nb, 16 * GGUF_PANEL)
    return packed


def _pack_q4_1(rows: torch.Tensor) -> torch.Tensor:
    b = rows.reshape(rows.shape[0], -1, 20)
    return _pack_q4(_f16(b, 0), -_f16(b, 2), b[..., 4:])


def _pack_q4_0(rows: torch.Tensor) -> torch.Tensor:
    b = rows.reshape(rows.shape[0], -1, 18)
    d = _f16(b, 0)
    return _pack_q4(d, 8 * d, b[..., 2:])


def _q4_1_values(packed: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    n, nb = packed.shape[:2]
    d = _column(packed, column, 0, 1, torch.float32)
    offset = _column(packed, column, _SCALES, 1, torch.float32)
    pairs = _column_pairs(packed, column, _Q4_1_QUANTS)                 # [n, nb, 8, 2 (t)]
    q = torch.stack([pairs & 0x0F, pairs >> 4], dim=-2).reshape(n, nb, 32).float()
    return (d * q - offset).view(n, -1)


# ---- Q5_1: d f16, m f16, qh u32, 16 bytes of 4-bit q; Q5_K: d, dmin f16, 12 bytes of scales and mins,
# ---- qh [32], 128 bytes of 4-bit q; Q5_0: d f16, qh u32, 16 bytes of 4-bit q ----

# Per panel and block of 32: d and the offset (float32, 64 bytes each), the 8 groups of 4 k-rows of
# nibbles as Q4_1's, then each group's fifth bits as two little-endian 32-bit words: bit i of the first
# is byte i's low nibble's, of the second its high nibble's. 0.875 bytes a weight.
_Q5_FIFTH_BITS = _Q4_1_QUANTS + 16 * GGUF_PANEL   # after a Q4_1 block
_Q5_BYTES = _Q5_FIFTH_BITS + 8 * 8


def _q5_quants(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """A block's 32 five-bit q (uint8 [..., 32], gguf.quants' order) from its 4 bytes of high bits (bit i:
    value i's) and 16 bytes of nibbles (byte i: value i low, value 16 + i high)."""
    bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1    # [..., 4 bytes, 8 bits]: value 8 byte + bit
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    return low | (bits.flatten(-2) << 4)


def _pack_q5(d: torch.Tensor, offset: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float32 d and offset [n, nb] and uint8 q [n, nb, 32] (0 .. 31) as the Q5 layout."""
    n, nb = d.shape
    low = q & 0x0F
    packed = torch.empty(n // GGUF_PANEL, nb, _Q5_BYTES, dtype=torch.uint8)
    packed[..., :_Q5_FIFTH_BITS] = _pack_q4(d, offset, low[..., :16] | (low[..., 16:] << 4))
    fifth = (q >> 4).reshape(n // GGUF_PANEL, GGUF_PANEL, nb, 8, 2, 2)       # [p, c, b, g, h, t]: k-row 4g + 2h + t
    fifth = fifth.permute(0, 2, 3, 4, 1, 5).reshape(n // GGUF_PANEL, nb, 8, 2, 4, 8)  # bit 2c + t: byte, bit
    words = torch.zeros(fifth.shape[:-1], dtype=torch.uint8)    # each word's 4 bytes, little-endian
    for bit in range(8):   # in uint8 throughout: a model's largest matrix packs without wide temporaries
        words |= fifth[..., bit] << bit
    packed[..., _Q5_FIFTH_BITS:] = words.reshape(n // GGUF_PANEL, nb, 64)
    return packed


def _pack_q5_1(rows: torch.Tensor) -> torch.Tensor:
    b = rows.reshape(rows.shape[0], -1, 24)
    return _pack_q5(_f16(b, 0), -_f16(b, 2), _q5_quants(b[..., 4:8], b[..., 8:]))


# Q5_K per panel and super-block: d and dmin (float32, 64 bytes each), the 8 scales and 8 mins (128 bytes
# each) as Q4_K's, then each sub-block of 32's q (0 .. 31; values (d sc) q - dmin m) in 5 runs of 64 bytes,
# byte 4c + t of each holding column c's k-row t of a group of 4 k-rows: the fifth bits of groups 0 .. 7
# (bit g), then the low 4 bits of groups 0 (low nibble) and 1 (high nibble), of 2 and 3, 4 and 5, 6 and 7.
# 0.72 bytes a weight.
_Q5_K_RUNS = 5
_Q5_K_BYTES = _Q4_K_QUANTS + 8 * _Q5_K_RUNS * 4 * GGUF_PANEL


def _q5_k_quants(b: torch.Tensor) -> torch.Tensor:
    """A super-block's 256 q (uint8 0 .. 31, [..., 8 sub-blocks, 32], gguf.quants' order)."""
    lead = b.shape[:-1]
    # 4 runs of 32 bytes: the low nibbles are sub-block 2i, the high ones 2i + 1; bit j of qh's byte t is
    # value t's fifth bit in sub-block j.
    qs = b[..., 48:].reshape(*lead, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    high = b[..., 16:48].reshape(*lead, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
    return (qs & 0x0F).reshape(*lead, 8, 32) | ((high & 1) << 4)


def _pack_q5_k(rows: torch.Tensor) -> torch.Tensor:
    n = rows.shape[0]
    b = rows.reshape(n, -1, 176)
    nb = b.shape[1]
    q = _q5_k_quants(b).view(n, nb, 8, 8, 4)                             # [.., sub-block j, group g, t]
    low, fifth = q & 0x0F, q >> 4
    fifth_run = torch.zeros(n, nb, 8, 1, 4, dtype=torch.uint8)
    for g in range(8):   # in uint8 throughout: a model's largest matrix packs without wide temporaries
        fifth_run[..., 0, :] |= fifth[..., g, :] << g
    runs = torch.cat([fifth_run, low[..., 0::2, :] | (low[..., 1::2, :] << 4)], dim=3)   # [n, nb, 8, 5, t]
    packed = _super_block_header(b, _Q5_K_BYTES)
    by_column = _panels(runs).view(-1, nb, 8, _Q5_K_RUNS, 4, GGUF_PANEL).transpose(-1, -2)   # [.., j, run, c, t]
    packed[..., _Q4_K_QUANTS:] = by_column.reshape(-1, nb, 8 * _Q5_K_RUNS * 4 * GGUF_PANEL)
    return packed


def _q5_k_values(packed: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    n, nb = packed.shape[:2]
    scale, low = _super_block_scales(packed, column)
    runs = packed[..., _Q4_K_QUANTS:].reshape(n, nb, 8, _Q5_K_RUNS, GGUF_PANEL, 4)
    runs = runs.gather(4, column.view(n, 1, 1, 1, 1, 1).expand(n, nb, 8, _Q5_K_RUNS, 1, 4)).squeeze(4)  # j, run, t
    nibbles = runs[..., 1:, :]
    q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=4).flatten(3, 4)                # [n, nb, 8, 8 (g), t]
    q = q | (((runs[..., :1, :] >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1) << 4)
    return (scale.unsqueeze(-1) * q.reshape(n, nb, 8, 32).float() - low.unsqueeze(-1)).view(n, -1)


def _pack_q5_0(rows: torch.Tensor) -> torch.Tensor:
    b = rows.reshape(rows.shape[0], -1, 22)
    q = _q5_quants(b[..., 2:6], b[..., 6:]).view(torch.int8) - 16
    return _pack_int8(_f16(b, 0), q)


def _q5_values(packed: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    n, nb = packed.shape[:2]
    d = _column(packed, column, 0, 1, torch.float32)
    offset = _column(packed, column, _SCALES, 1, torch.float32)
    pairs = _column_pairs(packed[..., :_Q5_FIFTH_BITS], column, _Q4_1_QUANTS)  # [n, nb, 8, 2 (t)]
    low = torch.stack([pairs & 0x0F, pairs >> 4], dim=-2)                      # [n, nb, 8 (g), 2 (h), 2 (t)]
    words = packed[..., _Q5_FIFTH_BITS:].contiguous().view(torch.int32).view(n, nb, 8, 2, 1)
    shifts = 2 * column.view(n, 1, 1, 1, 1) + torch.arange(2).view(1, 1, 1, 1, 2)
    fifth = ((words >> shifts) & 1).to(torch.uint8)                             # [n, nb, 8, 2, 2]
    q = (low | (fifth << 4)).reshape(n, nb, 32).float()
    return (d * q - offset).view(n, -1)


GGUF_FORMATS: dict[str, GGUFFormat] = {f.name: f for f in (
    GGUFFormat("Q8_0", 0, 32, 34, 32, _SCALES + 32 * GGUF_PANEL, _pack_q8_0, _int8_values),
    GGUFFormat("Q6_K", 1, 256, 210, 256, _Q6_K_BYTES, _pack_q6_k, _q6_k_values),
    GGUFFormat("Q4_K", 2, 256, 144, 256, _Q4_K_QUANTS + 128 * GGUF_PANEL, _pack_q4_k, _q4_k_values),
    GGUFFormat("Q4_1", 3, 32, 20, 32, _Q4_1_QUANTS + 16 * GGUF_PANEL, _pack_q4_1, _q4_1_values),
    GGUFFormat("Q4_0", 3, 32, 18, 32, _Q4_1_QUANTS + 16 * GGUF_PANEL, _pack_q4_0, _q4_1_values),   # packed as Q4_1
    GGUFFormat("Q5_1", 4, 32, 24, 32, _Q5_BYTES, _pack_q5_1, _q5_values),
    GGUFFormat("Q5_K", 5, 256, 176, 256, _Q5_K_BYTES, _pack_q5_k, _q5_k_values),
    GGUFFormat("Q5_0", 0, 32, 22, 32, _SCALES + 32 * GGUF_PANEL, _pack_q5_0, _int8_values),       # packed as Q8_0
)}


def gguf_packable(fmt: GGUFFormat, n: int, k: int) -> bool:
    """Whether rows [n, k] of `fmt` pack: whole panels of 16 rows, whole file blocks along K."""
    return n > 0 and n % GGUF_PANEL == 0 and k > 0 and k % fmt.file_block == 0


def pack_gguf_weight(parts: list[tuple[GGUFFormat, torch.Tensor]], k: int) -> torch.Tensor:
    """A weight [N, k] from its parts stacked along N, each (format, its file rows [n, row bytes] uint8),
    as linear_gguf's uint8 blob (header, then one segment per part, parts of one format in a row merged)."""
    segments: list[tuple[GGUFFormat, list[torch.Tensor]]] = []
    for fmt, rows in parts:
        if segments and segments[-1][0] is fmt:
            segments[-1][1].append(rows)
        else:
            segments.append((fmt, [rows]))
    counts = [sum(r.shape[0] for r in rows) for _, rows in segments]
    header_bytes = -(-8 * (3 + 3 * len(segments)) // _ALIGN) * _ALIGN
    offsets, total = [], header_bytes
    for (fmt, _), count in zip(segments, counts):
        offsets.append(total)
        total += -(-_packed_bytes(fmt, count, k) // _ALIGN) * _ALIGN
    header = [k, sum(counts), len(segments)]
    for (fmt, _), count, offset in zip(segments, counts, offsets):
        header += [fmt.code, count, offset]
    blob = torch.zeros(total, dtype=torch.uint8)
    blob[:8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    for (fmt, rows), count, offset in zip(segments, counts, offsets):
        end = offset + _packed_bytes(fmt, count, k)
        for part in rows:
            offset = _pack_rows_into(blob, offset, fmt, part)
        assert offset == end, f"{fmt.name}: packed {offset} bytes where its segment ends at {end}"
    return blob


# Rows packed at a time: a packer's intermediates (several bytes a weight) then stay a few MB, where
# over a whole output head (32k x 2k weights, say) they made the load's RSS peak.
_PACK_ROWS = 1024


def _pack_rows_into(blob: torch.Tensor, offset: int, fmt: GGUFFormat, rows: torch.Tensor) -> int:
    """`rows` (file rows of `fmt`, whole panels) packed into `blob` from `offset`; where they end."""
    for start in range(0, rows.shape[0], _PACK_ROWS):
        packed = fmt.pack(rows[start:start + _PACK_ROWS].contiguous()).reshape(-1)
        blob[offset:offset + packed.numel()] = packed
        offset += packed.numel()
    return offset


def _packed_bytes(fmt: GGUFFormat, rows: int, k: int) -> int:
    """The bytes of `rows` rows of `fmt` in the kernel's panels."""
    return rows // GGUF_PANEL * (k // fmt.block) * fmt.packed_bytes


def gguf_segments(blob: torch.Tensor) -> tuple[int, list[tuple[GGUFFormat, int, torch.Tensor]]]:
    """(K, each segment's (format, first row, its panels [rows / 16, K / block, packed_bytes])) of a blob."""
    k, _, count = blob[:24].view(torch.int64).tolist()
    fields = blob[24:24 + 24 * count].view(torch.int64).view(count, 3).tolist()
    by_code: dict[int, GGUFFormat] = {}
    for f in GGUF_FORMATS.values():
        by_code.setdefault(f.code, f)   # Q4_0's packed blocks are Q4_1's, Q5_0's Q8_0's
    segments, row = [], 0
    for code, rows, offset in fields:
        fmt = by_code[code]
        size = _packed_bytes(fmt, rows, k)
        segments.append((fmt, row, blob[offset:offset + size].view(rows // GGUF_PANEL, k // fmt.block, -1)))
        row += rows
    return k, segments


def gguf_rows(blob: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows `rows` of a packed weight, dequantized to float32 [len(rows), K] (an embedding's lookup)."""
    k, segments = gguf_segments(blob)
    out = torch.empty(rows.shape[0], k)
    for fmt, first, panels in segments:
        mine = (rows >= first) & (rows < first + panels.shape[0] * GGUF_PANEL)
        if bool(mine.any()):
            local = rows[mine] - first
            out[mine] = fmt.values(panels[local // GGUF_PANEL], local % GGUF_PANEL)
    return out
