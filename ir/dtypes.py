"""Element types of the IR and their NumPy storage types (bf16 and the FP8 types through ml_dtypes)."""

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from pegainfer.errors import ConfigError


@dataclass(frozen=True)
class DType:
    name: str
    np_dtype: np.dtype
    is_float: bool

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    def __str__(self) -> str:
        return self.name


BF16 = DType("bf16", np.dtype(ml_dtypes.bfloat16), True)
FP16 = DType("f16", np.dtype(np.float16), True)
FP32 = DType("f32", np.dtype(np.float32), True)
F8E4M3 = DType("f8e4m3", np.dtype(ml_dtypes.float8_e4m3fn), True)  # FP8 weights as checkpoints store them
F8E5M2 = DType("f8e5m2", np.dtype(ml_dtypes.float8_e5m2), True)
INT32 = DType("i32", np.dtype(np.int32), False)
INT64 = DType("i64", np.dtype(np.int64), False)

_ALIASES = {
    "bf16": BF16, "bfloat16": BF16, "torch.bfloat16": BF16, "BF16": BF16,
    "f16": FP16, "fp16": FP16, "float16": FP16, "torch.float16": FP16, "F16": FP16,
    "f32": FP32, "fp32": FP32, "float32": FP32, "float": FP32, "torch.float32": FP32, "F32": FP32,
    "f8e4m3": F8E4M3, "float8_e4m3fn": F8E4M3, "torch.float8_e4m3fn": F8E4M3, "F8_E4M3": F8E4M3,
    "f8e5m2": F8E5M2, "float8_e5m2": F8E5M2, "torch.float8_e5m2": F8E5M2, "F8_E5M2": F8E5M2,
    "i32": INT32, "int32": INT32, "I32": INT32,
    "i64": INT64, "int64": INT64, "I64": INT64,
}


def dtype_from_name(name: str) -> DType:
    """Accepts the IR's, NumPy's, torch's and safetensors' spellings."""
    try:
        return _ALIASES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; expected one of {sorted(_ALIASES)}") from None
