"""GGML tensor types: their ids (fixed by the GGUF format) and one table of block sizes.

A type stores `block_size` values in `type_size` bytes (`GGML_TYPE_SIZES`); plain types (F32,
F16, BF16, the integers) are blocks of one value. Ids, names and sizes are those of the `gguf`
package's `GGMLQuantizationType` and `GGML_QUANT_SIZES` (a unit test checks that they agree);
they are kept here so that reading a file needs no `gguf` import, which costs about 2 MB and
40 ms (it pulls in sentencepiece and yaml).
"""

from __future__ import annotations

from enum import IntEnum

_QK_K = 256  # values per K-quant super-block


class GGMLType(IntEnum):
    """A GGML tensor type; `GGMLType(id)` raises ValueError for an id this table lacks."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41

    @property
    def block_size(self) -> int:
        """Values per block."""
        return GGML_TYPE_SIZES[self][0]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return GGML_TYPE_SIZES[self][1]


# type -> (values per block, bytes per block)
GGML_TYPE_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32:     (1, 4),
    GGMLType.F16:     (1, 2),
    GGMLType.Q4_0:    (32, 2 + 16),
    GGMLType.Q4_1:    (32, 2 + 2 + 16),
    GGMLType.Q5_0:    (32, 2 + 4 + 16),
    GGMLType.Q5_1:    (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0:    (32, 2 + 32),
    GGMLType.Q8_1:    (32, 4 + 4 + 32),
    GGMLType.Q2_K:    (_QK_K, 2 + 2 + _QK_K // 16 + _QK_K // 4),
    GGMLType.Q3_K:    (_QK_K, 2 + _QK_K // 4 + _QK_K // 8 + 12),
    GGMLType.Q4_K:    (_QK_K, 2 + 2 + 12 + _QK_K // 2),
    GGMLType.Q5_K:    (_QK_K, 2 + 2 + 12 + _QK_K // 8 + _QK_K // 2),
    GGMLType.Q6_K:    (_QK_K, _QK_K // 2 + _QK_K // 4 + _QK_K // 16 + 2),
    GGMLType.Q8_K:    (_QK_K, 4 + _QK_K + _QK_K // 8),
    GGMLType.IQ2_XXS: (_QK_K, 2 + _QK_K // 4),
    GGMLType.IQ2_XS:  (_QK_K, 2 + _QK_K // 4 + _QK_K // 32),
    GGMLType.IQ3_XXS: (_QK_K, 2 + _QK_K // 4 + _QK_K // 8),
    GGMLType.IQ1_S:   (_QK_K, 2 + _QK_K // 8 + _QK_K // 16),
    GGMLType.IQ4_NL:  (32, 2 + 16),
    GGMLType.IQ3_S:   (_QK_K, 2 + _QK_K // 4 + _QK_K // 8 + _QK_K // 32 + 4),
    GGMLType.IQ2_S:   (_QK_K, 2 + _QK_K // 4 + _QK_K // 16),
    GGMLType.IQ4_XS:  (_QK_K, 2 + 2 + _QK_K // 64 + _QK_K // 2),
    GGMLType.I8:      (1, 1),
    GGMLType.I16:     (1, 2),
    GGMLType.I32:     (1, 4),
    GGMLType.I64:     (1, 8),
    GGMLType.F64:     (1, 8),
    GGMLType.IQ1_M:   (_QK_K, _QK_K // 8 + _QK_K // 16 + _QK_K // 32),
    GGMLType.BF16:    (1, 2),
    GGMLType.TQ1_0:   (_QK_K, 2 + 4 * 13),
    GGMLType.TQ2_0:   (_QK_K, 2 + _QK_K // 4),
    GGMLType.MXFP4:   (32, 1 + 16),
    GGMLType.NVFP4:   (64, 4 + 32),
    GGMLType.Q1_0:    (128, 2 + 16),
}
