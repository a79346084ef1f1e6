"""Unit constants and dtype sizes. Names elsewhere carry their unit (`*_bytes`, `*_s`, `*_gbps`)."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9  # link rates are decimal (GB/s), capacities binary (GiB)

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4, "float32": 4,
    "bf16": 2, "bfloat16": 2,
    "fp16": 2, "float16": 2,
    "int8": 1, "fp8": 1,
}


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(DTYPE_BYTES)}") from None
