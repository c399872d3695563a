"""What every Triton kernel file shares: whether kernels run in Triton's interpreter, and a
bf16-correct cast for the stores.

Triton 3.9's interpreter (TRITON_INTERPRET=1, read once here: triton.jit decides at import
whether a kernel is interpreted) has two faults the kernels work around behind constexpr flags,
off on a GPU: `tl.dot` on bf16 operands gives wrong sums (kernels cast both operands to fp32
first, `INTERPRET`), and an fp32 -> bf16 cast truncates instead of rounding to nearest even
(`cast` rounds with integer math, `EMULATE_BF16`).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
EMULATE_BF16 = INTERPRET


@triton.jit
def cast(y, ty: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """y converted to dtype `ty`, rounded to nearest even (NaN stays NaN); with EMULATE_BF16
    (the interpreter), a bf16 result is rounded with integer math."""
    if EMULATE_BF16 and ty == tl.bfloat16:
        f = y.to(tl.float32)
        bits = f.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        r = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(f != f, f.to(tl.bfloat16), r)
    else:
        return y.to(ty)
