"""The paged attention kernels compile for an sm_90 GPU, checked on a machine without one.

The interpreter accepts code that the compiler rejects (a plain-float global in a kernel, for
one), so without a GPU this test runs Triton's real pipeline (TTIR, TTGIR, PTX and ptxas to a
cubin) in a subprocess with TRITON_INTERPRET unset and a fresh cache; it prints each
kernel's stack use (register spills, which vary with the Triton version; `pytest -s` shows
them). On a GPU the other tests compile the kernels for real, so it is skipped there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = r'''
import os, subprocess, sys, tempfile
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print("SKIP", e); sys.exit(3)
from localllm.kernels import triton_decode_attention as D, triton_extend_attention as E

def compile_one(fn, types, consts, options):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    try:
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                             for k, v in consts.items()})
    except TypeError as e:
        print("SKIP", e); sys.exit(3)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as e:
        if "ptxas" in str(e):
            print("SKIP", e); sys.exit(3)
        raise
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
        stack = [w for w in usage.stdout.split() if w.startswith("STACK:")]
        print(fn.__name__, types["q_ptr"], consts, stack)

for dt, group, head_dim, block_size, softcap in [("bf16", 3, 64, 16, True),
                                                 ("bf16", 8, 128, 1, False),
                                                 ("bf16", 16, 256, 32, True),
                                                 ("fp32", 1, 8, 16, False)]:
    types = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    types.update(bt_ptr="*i32", ctx_ptr="*i64", qs_ptr="*i32", part_acc_ptr="*fp32",
                 part_lse_ptr="*fp32", scale="fp32", softcap="fp32")
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, SOFTCAP=softcap,
                  DOT_FP32=False, DOT_PREC="ieee" if dt == "fp32" else "tf32")
    block_d, block_h, block_n = D.decode_tiles(head_dim, group)
    compile_one(D._decode_split_kernel, types,
                dict(common, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=block_n, SINGLE=False),
                dict(num_warps=4, num_stages=2))
    compile_one(D._decode_merge_kernel, types,
                dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=8), dict(num_warps=2))
    block_d, block_m, block_n, warps = E.extend_tiles(head_dim, group)
    compile_one(E._extend_kernel, types,
                dict(common, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SEARCH=128),
                dict(num_warps=warps, num_stages=2))
print("OK")
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the other tests compile on this GPU")
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                             text=True, timeout=600)
    if run.returncode == 3:
        pytest.skip(f"Triton cannot compile for sm_90 here: {run.stdout.strip()}")
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.strip().endswith("OK")
    print(run.stdout)
