"""GGUF container constants: value types and ggml tensor types with their block geometry."""

from __future__ import annotations

from enum import IntEnum

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
GGUF_DEFAULT_ALIGNMENT = 32
QK_K = 256  # super-block size of the K-quants and IQ types
QK_MXFP4 = 32  # MXFP4 block: one E8M0 exponent byte, then 32 FP4 (E2M1) nibbles


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Little-endian struct format of each fixed-size metadata value type (numpy reads the same format strings).
VALUE_FORMAT: dict[ValueType, str] = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}


class GGMLType(IntEnum):
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
    MXFP4 = 39


# (elements per block, bytes per block) for the types DwarfStar reads and writes.
BLOCK_GEOMETRY: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I8: (1, 1),  # raw bytes: V4.1's Engram table rows (engram/rows.py)
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q2_K: (QK_K, 84),
    GGMLType.Q4_K: (QK_K, 144),
    GGMLType.IQ2_XXS: (QK_K, 66),
    GGMLType.MXFP4: (QK_MXFP4, 17),
}


def tensor_nbytes(ggml_type: GGMLType, n_elements: int, row_length: int) -> int:
    """Bytes a tensor of this type occupies. Rows (ne0) must hold whole blocks, as in ggml."""
    block, size = BLOCK_GEOMETRY[ggml_type]
    if row_length % block:
        raise ValueError(f"{ggml_type.name} needs rows that are a multiple of {block} elements, got {row_length}")
    return n_elements // block * size
