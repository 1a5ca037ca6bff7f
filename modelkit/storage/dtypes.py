"""Tensor helpers shared by converters: dtype names and raw bytes."""
from __future__ import annotations

import torch

# safetensors dtype codes (https://github.com/huggingface/safetensors#format) <-> torch.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8, "I8": torch.int8,
    "U16": torch.uint16, "I16": torch.int16,
    "U32": torch.uint32, "I32": torch.int32,
    "U64": torch.uint64, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_CODES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# torch's legacy typed storage classes (still named in TorchScript archives and old checkpoints) -> dtype.
LEGACY_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}

# Short names users type (`--dtype bf16`) -> torch.
DTYPE_NAMES: dict[str, torch.dtype] = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the name used in reports and JSON."""
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order (little-endian on every platform torch supports here).

    Viewing as uint8 first works for dtypes numpy lacks (bfloat16, float8).
    """
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
