"""Element types a KV region may hold, with their exact sizes in bits.

Sizes are in bits, not bytes, because FP4 packs two values per byte: a region's byte size is
only known once its value count is (see :class:`tessera_ray.layout.spec.Region`).
"""

from __future__ import annotations

import enum

__all__ = ["DType"]


class DType(enum.Enum):
    """A stored element type. The value is the name used in configs, JSON and the CLI."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8_E4M3 = "fp8_e4m3"
    FP4_E2M1 = "fp4_e2m1"
    UE8M0 = "ue8m0"
    INT8 = "int8"

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def torch_name(self) -> str:
        """Name of the matching ``torch`` dtype attribute; layout never imports torch itself.

        FP4 maps to torch's packed pair type, so a region of N fp4 values views as N/2 elements.
        """
        return _TORCH_NAMES[self]

    @classmethod
    def parse(cls, name: str) -> DType:
        from tessera_ray.errors import UnknownNameError

        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(d.value for d in cls)
            raise UnknownNameError(f"unknown dtype {name!r}; valid: {valid}") from None


_BITS: dict[DType, int] = {
    DType.BF16: 16,
    DType.FP16: 16,
    DType.FP32: 32,
    DType.FP8_E4M3: 8,
    DType.FP4_E2M1: 4,
    DType.UE8M0: 8,
    DType.INT8: 8,
}

_TORCH_NAMES: dict[DType, str] = {
    DType.BF16: "bfloat16",
    DType.FP16: "float16",
    DType.FP32: "float32",
    DType.FP8_E4M3: "float8_e4m3fn",
    DType.FP4_E2M1: "float4_e2m1fn_x2",
    DType.UE8M0: "float8_e8m0fnu",
    DType.INT8: "int8",
}
