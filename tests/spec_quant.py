"""SPEC 9's formats in NumPy, written from the SPEC's table apart from kvcheck's C++ (a third
implementation: the reference's and the optimized caches' share no code with it either).

quantize(fmt, x) takes one float32 row and returns (codes, scales, zeros); dequantize
inverts it. fmt is the manifest's kv_quant["k"] or ["v"] of a `kvcheck export`."""

import numpy as np

F32, F64 = np.float32, np.float64
RANGE = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0, "q8_0": 127.0, "q4_0": 8.0, "int4": 15.0, "int2": 3.0,
         "int8_even": 127.0, "int4_even": 7.0}
EVEN = {"int8_even": (-128, 127), "int4_even": (-8, 7)}  # SPEC 9.6: ties to even, the whole range
BOUNDARY = 2.0 ** -20  # SPEC 9.2.1's "within a few float32 ulps", relative to the row's largest element


def round_away(y):
    """Round half away from zero, exactly (in float64)."""
    y = np.asarray(y, dtype=F64)
    return np.sign(y) * np.floor(np.abs(y) + 0.5)


def fp8_values(name):
    """The value of every positive finite bit pattern, in order (0 .. the largest)."""
    m, bias, top = (3, 7, 0x7E) if name == "fp8_e4m3" else (2, 15, 0x7B)
    out = []
    for c in range(top + 1):
        e, f = c >> m, c & ((1 << m) - 1)
        out.append(f / (1 << m) * 2.0 ** (1 - bias) if e == 0 else (1 + f / (1 << m)) * 2.0 ** (e - bias))
    return np.array(out)


def fp8_encode(name, y):
    """Nearest pattern, ties to the even one, saturating; sign in bit 7."""
    table = fp8_values(name)
    a = np.minimum(np.abs(y), table[-1])
    hi = np.clip(np.searchsorted(table, a), 1, len(table) - 1)
    lo = hi - 1
    d_lo, d_hi = a - table[lo], table[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(np.signbit(y), code | 0x80, code), table


def scale_dtype(fmt):
    return np.float16 if fmt["scale"]["dtype"] == "float16" else F32


def quantize(fmt, x, kv_head=0):
    """(codes, scales, zeros, near): one float32 row of head_dim."""
    x = np.asarray(x, dtype=F32)
    name, group = fmt["format"], fmt["scale"]["elements"]
    window = BOUNDARY * float(np.max(np.abs(x))) if x.size else 0.0
    codes, scales, zeros, near = [], [], [], []
    for g0 in range(0, len(x), group):
        xs = x[g0:g0 + group]
        if name in ("q8_0", "q4_0"):
            if name == "q8_0":
                d = F32(np.max(np.abs(xs))) / F32(127)
                y = xs * (F32(1) / d if d else F32(0))
                c = round_away(y)
                dist = np.abs(np.abs(y.astype(F64)) - np.floor(np.abs(y.astype(F64))) - 0.5)
            else:
                m = xs[int(np.argmax(np.abs(xs)))]
                d = F32(m) / F32(-8)
                y = xs * (F32(1) / d if d else F32(0)) + F32(8.5)
                c = np.minimum(15, np.trunc(y.astype(F64)))
                dist = np.abs(y.astype(F64) - np.round(y.astype(F64)))
            scales.append(float(np.float16(d)))
            near.append((dist <= window / abs(float(d))) if d else np.zeros(len(xs), bool))
            codes.append(c)
        elif name in ("int4", "int2"):
            lo, hi = float(xs.min()), float(xs.max())
            if lo == hi:
                lo, hi = min(lo, 0.0), max(hi, 0.0)
            top = RANGE[name]
            s = float(scale_dtype(fmt)(F32((hi - lo) / top)))
            z = int(round_away(-lo / s)) if s else 0
            y = xs.astype(F64) / s if s else np.zeros(len(xs))
            codes.append(np.clip(round_away(y) + z, 0, top))
            scales.append(s)
            zeros.append(z)
            near.append(np.abs(np.abs(y - np.floor(y)) - 0.5) <= (window / s if s else -1))
        else:
            value = fmt["scale"]["value"]
            if value == "amax":
                s = float(scale_dtype(fmt)(F32(float(np.max(np.abs(xs))) / RANGE[name])))
            else:
                s = float(F32(value[kv_head] if isinstance(value, list) and len(value) > 1 else
                              (value[0] if isinstance(value, list) else value)))
            y = xs.astype(F64) / s if s else np.zeros(len(xs))
            if name == "int8":
                codes.append(np.clip(round_away(y), -127, 127))
                near.append(np.abs(np.abs(y - np.floor(y)) - 0.5) <= (window / s if s else -1))
            elif name in EVEN:
                codes.append(np.clip(np.rint(y), *EVEN[name]))  # NumPy's rint: half to even
                near.append(np.abs(np.abs(y - np.floor(y)) - 0.5) <= (window / s if s else -1))
            else:
                c, table = fp8_encode(name, y)
                codes.append(c)
                # near the midpoint to a neighbouring pattern of the same sign
                mag = table[c & 0x7F]
                up = table[np.minimum((c & 0x7F) + 1, len(table) - 1)]
                down = table[np.maximum((c & 0x7F) - 1, 0)]
                a = np.abs(y)
                near.append((np.abs(a - (mag + up) / 2) <= window / s) | (np.abs(a - (mag + down) / 2) <= window / s))
            scales.append(s)
    return (np.concatenate(codes).astype(np.int64), np.array(scales), np.array(zeros, dtype=np.int64),
            np.concatenate(near))


def quantize_together(fmt, rows, kv_head=0):
    """[(codes, scales, zeros, near)] for rows [n, head_dim] of float32 quantized together: each
    alone, or, with scales along the token axis ("axis": "token"), each channel of each run of
    "group" tokens (0: all n) quantized as one row of a per-token scale; a row then holds its
    run's scale (and zero point) for each of its elements."""
    rows = np.asarray(rows, dtype=F32)
    if fmt["scale"].get("axis") != "token":
        return [quantize(fmt, x, kv_head) for x in rows]
    n, d = rows.shape
    run = fmt["scale"]["group"] or max(n, 1)
    out = [(np.zeros(d, np.int64), np.zeros(d), np.zeros(d, np.int64), np.zeros(d, bool)) for _ in range(n)]
    for t0 in range(0, n, run):
        column_fmt = dict(fmt, scale=dict(fmt["scale"], elements=min(run, n - t0)))
        for c in range(d):
            codes, scales, zeros, near = quantize(column_fmt, rows[t0:t0 + run, c], kv_head)
            for t in range(len(codes)):
                out[t0 + t][0][c], out[t0 + t][1][c], out[t0 + t][3][c] = codes[t], scales[0], near[t]
                if len(zeros):
                    out[t0 + t][2][c] = zeros[0]
    return out


def dequantize(fmt, codes, scales, zeros):
    name, group = fmt["format"], fmt["scale"]["elements"]
    s = np.repeat(np.asarray(scales, dtype=F64), group)
    if name in ("fp8_e4m3", "fp8_e5m2"):
        table = fp8_values(name)
        return np.where(codes & 0x80, -1.0, 1.0) * table[codes & 0x7F] * s
    if name == "q4_0":
        return (codes - 8) * s
    if name in ("int4", "int2"):
        return (codes - np.repeat(zeros, group)) * s
    return codes * s


def hadamard(n):
    """The normalized Sylvester Hadamard matrix (n a power of two)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)
