"""Regenerates gguf_py_refs.json: gguf-py's numpy dequantization of pseudo-random blocks.

Run: python3 gen_gguf_py_refs.py  (needs gguf 0.19.0 and numpy). Block bytes are random except the
f16 scale fields, which are set to finite values so every output is an ordinary float.
"""
import json

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

rng = np.random.default_rng(20240611)


def f16(x):
    return np.array([x], dtype=np.float16).view(np.uint8)


def scale(lo=-6.0, hi=0.0, signed=True):
    mag = 10.0 ** rng.uniform(lo, hi)
    return -mag if signed and rng.random() < 0.5 else mag


# (type, n_blocks, [(byte offset of an f16 scale field, signed?)])
CASES = [
    (T.F16, 64, []),
    (T.BF16, 64, []),
    (T.Q4_0, 4, [(0, True)]),
    (T.Q4_1, 4, [(0, False), (2, True)]),
    (T.Q5_0, 4, [(0, True)]),
    (T.Q5_1, 4, [(0, False), (2, True)]),
    (T.Q8_0, 4, [(0, True)]),
    (T.Q2_K, 2, [(80, False), (82, False)]),
    (T.Q3_K, 2, [(108, True)]),
    (T.Q4_K, 2, [(0, False), (2, False)]),
    (T.Q5_K, 2, [(0, False), (2, False)]),
    (T.Q6_K, 2, [(208, True)]),
]

out = []
for ty, n_blocks, fields in CASES:
    block_size, type_size = GGML_QUANT_SIZES[ty]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if ty == T.F16:
        # avoid NaN/inf so values compare bit-exactly (NaNs are covered by the unit tests)
        h = raw.view(np.uint16)
        h[(h & 0x7C00) == 0x7C00] &= 0xBFFF
    if ty == T.BF16:
        h = raw.view(np.uint16)
        h[(h & 0x7F80) == 0x7F80] &= 0xBFFF
    for b in range(n_blocks):
        for off, signed in fields:
            raw[b, off:off + 2] = f16(scale(signed=signed))
    values = dequantize(raw.reshape(-1), ty).astype(np.float32).reshape(-1)
    assert values.size == n_blocks * block_size and np.isfinite(values).all()
    out.append({
        "type": ty.name,
        "n": int(values.size),
        "bytes_hex": raw.tobytes().hex(),
        "f32_bits_hex": values.view(np.uint32).astype(">u4").tobytes().hex(),
    })

with open("gguf_py_refs.json", "w") as f:
    json.dump({"generator": "gen_gguf_py_refs.py, gguf 0.19.0, numpy " + np.__version__, "cases": out}, f, indent=1)
