"""The ``native`` path: the reference ViT's training step on two C++ kernels, attention
(:class:`FusedCPUAttention`, all heads of an image in one call from the packed ``qkv``) and,
at AVX-512 only, residual add + LayerNorm (:class:`AddLayerNorm`, one pass each way). Each
is built on first use (about 1 s) for the instruction-set class PyTorch runs at
(:func:`build_target`), one library per shape class, under ``$VIT_MNIST_CACHE/kernels``.
Inputs a kernel cannot take (over 128 tokens, heads over 64 wide, float16, attention
dropout, tracing) run on PyTorch operations. docs/speed.md has the figures."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from vit_mnist.hardware import cpuinfo_flags, isa_class
from vit_mnist.speed import cache_root
from vit_mnist.speed.forward import add_norm as pytorch_add_norm
from vit_mnist.speed.forward import reference_core, written_backward_applies

SOURCES = {k: Path(__file__).with_name(f"{k}_cpu.cpp") for k in ("attention", "layer_norm")}
MAX_TOKENS, MAX_HEAD_DIM = 128, 64  # the attention kernel's per-thread buffers
MAX_NORM_DIM = 256  # a LayerNorm row of up to 16 vectors stays in registers
FLAGS = ("-std=c++17", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
TARGET_FLAGS = {"AVX-512": (), "AVX2": ("-mno-avx512f",)}  # added to FLAGS per target
LANES = {"AVX-512": 16, "AVX2": 8}  # the attention kernel's vector width in floats
_TARGETS = {"AVX2": "AVX2", "AVX-512": "AVX-512", "AVX512-BF16": "AVX-512", "AMX": "AVX-512"}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
FAILURES: dict[str, str] = {}  # library name -> why its build or load failed in this process


def build_target() -> str | None:
    """What the kernels are built for: ``"AVX-512"`` where PyTorch's own CPU kernels run
    AVX-512, ``"AVX2"`` where they run AVX2 (an AVX2 CPU, or an AVX-512 one under
    ``ATEN_CPU_CAPABILITY=avx2``), else None (ARM, an older x86)."""
    return _TARGETS.get(isa_class())


def lanes() -> int:
    """The attention kernel's vector width here, in floats: 16 or 8."""
    return LANES.get(build_target(), 8)


def compiler() -> str | None:
    """``$CXX``, else ``c++``, ``g++`` or ``clang++`` on the PATH, else None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((p for c in names if (p := shutil.which(c))), None)


def build(kernel: str, defines: tuple[str, ...]) -> Path:
    """Compile ``SOURCES[kernel]`` with ``FLAGS`` and ``defines`` into
    ``$VIT_MNIST_CACHE/kernels/<kernel>_<hash>.so`` (the hash covers the source, compiler,
    flags and this CPU's flags: ``-march=native`` code is for this CPU only) and return its
    path. Raises RuntimeError (why) on failure."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = [SOURCES[kernel].read_text(), cxx, version, *FLAGS, *defines, *sorted(cpuinfo_flags())]
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{kernel}_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # A temporary name, then renamed: no reader (another DDP process) sees half a library.
    with tempfile.TemporaryDirectory(dir=target.parent, suffix=".tmp") as tmp:
        cmd = [cxx, *FLAGS, *defines, str(SOURCES[kernel]), "-o", f"{tmp}/{target.name}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-500:]}")
        os.replace(f"{tmp}/{target.name}", target)
    return target


@functools.cache
def library(kernel: str, target: str | None, *defines: str) -> Any:
    """The ctypes library of ``kernel`` for ``target`` with ``defines``, its entry points
    typed; or None (a RuntimeWarning says why, kept in :data:`FAILURES`), where PyTorch's
    operations run instead with the same numbers."""
    if target is None or (kernel == "layer_norm" and target != "AVX-512"):
        return None  # the LayerNorm kernel is AVX-512 code; at AVX2 a build of it did not pay
    name = "_".join([kernel, *defines])
    try:
        lib = ctypes.CDLL(str(build(kernel, (*TARGET_FLAGS[target], *defines))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        FAILURES[name] = str(e)
        why = f"the {kernel} kernel is not available; PyTorch's operations run instead ({e})"
        warnings.warn(f"vit_mnist: {why}", RuntimeWarning, stacklevel=3)
        return None
    i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    rows, end = [ptr, i64, i64], [*[i64] * 5, f32]
    if kernel == "attention":
        lib.attn_forward.argtypes = [i32, *rows * 4, ptr, *end, i32, i32]
        lib.attn_backward.argtypes = [i32, *rows * 3, ptr, *rows * 4, *end, i32]
        lib.attn_forward.restype = lib.attn_backward.restype = None  # void
        return lib if lib.attn_lanes() == LANES[target] else None
    lib.add_norm_forward.argtypes = [i32, i32, i64, i64, *[ptr] * 8, f32, i32]
    lib.add_norm_backward.argtypes = [i32, i32, i64, i64, *[ptr] * 11, i32]
    lib.add_norm_forward.restype = lib.add_norm_backward.restype = None  # void
    return lib if lib.add_norm_available() else None  # 0 without AVX-512 F, BW and VL


def attention_defines(t_k: int, head_dim: int, width: int | None = None) -> tuple[str, ...]:
    """The attention library's shape class for ``t_k`` keys of ``head_dim`` features:
    key blocks and vectors per head row of ``width`` floats (default :func:`lanes`)."""
    width = width or lanes()
    vectors = -(-head_dim // width)
    return f"-DATTN_NB={-(-t_k // width)}", f"-DATTN_DV={4 if vectors == 3 else vectors}"


def build_failure(tokens: int, head_dim: int) -> str | None:
    """Why the attention kernel for ``tokens`` and heads of ``head_dim`` features cannot be
    built or loaded here (building it now if need be); None where it can, or where such
    inputs run on PyTorch operations by design. A failure warns once (:func:`library`)."""
    if not (1 <= tokens <= MAX_TOKENS and 1 <= head_dim <= MAX_HEAD_DIM):
        return None
    defines = attention_defines(tokens, head_dim)
    if library("attention", build_target(), *defines):
        return None
    return FAILURES.get("_".join(["attention", *defines]), "the library could not be loaded")


def kernel_for(q_src: torch.Tensor, kv_src: torch.Tensor | None, num_heads: int) -> Any:
    """The attention library for these inputs, or None where the kernel does not take them.
    ``q_src``: the packed projection (B, T, 3*D) when ``kv_src`` is None, else the queries
    (B, T_q, D) with ``kv_src`` (B, T_k, 2*D); float32 or bfloat16 CPU tensors, the last
    dimension contiguous."""
    kv = q_src if kv_src is None else kv_src
    head_dim = kv.shape[-1] // (3 if kv_src is None else 2) // num_heads
    takes = (
        all(t.device.type == "cpu" and t.dim() == 3 and t.stride(-1) == 1 for t in (q_src, kv))
        and kv.dtype == q_src.dtype in _DTYPES
        and 1 <= q_src.shape[1] <= MAX_TOKENS
        and 1 <= kv.shape[1] <= MAX_TOKENS
        and 1 <= head_dim <= MAX_HEAD_DIM
    )
    defines = attention_defines(kv.shape[1], head_dim) if takes else ()
    return library("attention", build_target(), *defines) if takes else None


def _rows(t: torch.Tensor, at: int = 0) -> list[int]:
    """A pointer to element ``at`` of row 0, and the batch and token strides (elements)."""
    return [t.data_ptr() + at * t.element_size(), t.stride(0), t.stride(1)]


def _qkv_args(q_src: torch.Tensor, kv_src: torch.Tensor | None, num_heads: int):
    """The kernel's arguments for Q, K and V (the dtype, then each one's rows) and its
    sizes (B, h, T_q, T_k, d_k)."""
    kv = q_src if kv_src is None else kv_src
    dim = kv.shape[-1] // (3 if kv_src is None else 2)
    k_at = dim if kv_src is None else 0
    args = [_DTYPES[q_src.dtype], *_rows(q_src), *_rows(kv, k_at), *_rows(kv, k_at + dim)]
    return args, [q_src.shape[0], num_heads, q_src.shape[1], kv.shape[1], dim // num_heads]


class FusedCPUAttention(torch.autograd.Function):
    """softmax(Q K^T * scale) V for all heads, forward and backward in the C++ kernel.

    Inputs: ``lib``, the library :func:`kernel_for` gave for ``q_src`` and ``kv_src`` (not
    None), and those as it takes them; query i is token i, for the causal mask. Output:
    (B, T_q, D), heads concatenated (ready for W^O). Saves the weights (B*h, T_q, T_k
    rounded up to a multiple of :func:`lanes`) in the inputs' dtype.
    """

    @staticmethod
    def forward(ctx, lib, q_src, kv_src, num_heads: int, scale: float, causal: bool):  # noqa: D102
        args, sizes = _qkv_args(q_src, kv_src, num_heads)
        b, h, t_q, t_k, d = sizes
        width = lanes()
        out = q_src.new_empty(b, t_q, h * d)
        weights = q_src.new_empty(b * h, t_q, -(-t_k // width) * width)
        tail = (scale, int(causal), torch.get_num_threads())
        lib.attn_forward(*args, *_rows(out), weights.data_ptr(), *sizes, *tail)
        ctx.save_for_backward(q_src, kv_src, weights)
        ctx.meta = (lib, num_heads, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        q_src, kv_src, weights = ctx.saved_tensors
        lib, num_heads, scale = ctx.meta
        grad_q_src = torch.empty_like(q_src)
        grad_kv_src = None if kv_src is None else torch.empty_like(kv_src)
        args, sizes = _qkv_args(q_src, kv_src, num_heads)
        grads = [
            *_rows(grad_out.contiguous()),
            *_qkv_args(grad_q_src, grad_kv_src, num_heads)[0][1:],
        ]
        threads = torch.get_num_threads()
        lib.attn_backward(*args, weights.data_ptr(), *grads, *sizes, scale, threads)
        return None, grad_q_src, grad_kv_src, None, None, None


def _norm_kernel(dim: int) -> Any:
    """The LayerNorm library for rows of ``dim`` floats (that many 16-float vectors)."""
    fits = 1 <= dim <= MAX_NORM_DIM
    return library("layer_norm", build_target(), f"-DLN_NV={-(-dim // 16)}") if fits else None


def add_norm_usable(x: torch.Tensor, branch: torch.Tensor | None, norm: nn.LayerNorm) -> bool:
    """Whether :class:`AddLayerNorm` takes these inputs: a contiguous float32 CPU stream
    ``x`` (..., D), D <= 256; ``branch`` None or of ``x``'s shape, float32 or bfloat16; a
    float32 LayerNorm over D with weight and bias; an AVX-512 build target. False while jit,
    ``torch.compile`` or ``torch.export`` trace."""
    return (
        not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() >= 2
        and x.is_contiguous()
        and (branch is None or branch.shape == x.shape and branch.device.type == "cpu")
        and (branch is None or branch.dtype in (torch.float32, torch.bfloat16))
        and tuple(norm.normalized_shape) == (x.shape[-1],)
        and all(p is not None and p.dtype == torch.float32 for p in (norm.weight, norm.bias))
        and _norm_kernel(x.shape[-1]) is not None
    )


def add_norm(x, branch, norm: nn.LayerNorm):
    """``(s, norm(s))`` with ``s = x + branch`` (``x`` when ``branch`` is None): the kernel
    where :func:`add_norm_usable` and a backward follows, else PyTorch's operations. ``x``
    (..., D) float32, ``branch`` as ``x`` in float32 or bfloat16; ``s`` float32, ``norm(s)``
    float32, or bfloat16 under CPU bf16 autocast (what autocast gives the Linear that reads
    it). Two-pass statistics (PyTorch: Welford), equal to float32 rounding."""
    if not (torch.is_grad_enabled() and x.requires_grad and add_norm_usable(x, branch, norm)):
        return pytorch_add_norm(x, branch, norm)
    bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with torch.autocast("cpu", enabled=False):
        out_dtype = torch.bfloat16 if bf16 else torch.float32
        return AddLayerNorm.apply(x, branch, norm.weight, norm.bias, norm.eps, out_dtype)


def _ptrs(*tensors: torch.Tensor | None) -> list[int | None]:
    return [None if t is None else t.data_ptr() for t in tensors]


class AddLayerNorm(torch.autograd.Function):
    """``(x + branch, LayerNorm(x + branch))`` in the C++ kernel; see :func:`add_norm`.
    Saves ``s`` (float32) and the rows' mean and 1/std, as PyTorch's LayerNorm does."""

    @staticmethod
    def forward(ctx, x, branch, weight, bias, eps: float, out_dtype: torch.dtype):  # noqa: D102
        dim, branch = x.shape[-1], None if branch is None else branch.contiguous()
        rows = x.numel() // dim
        s, y = torch.empty_like(x), torch.empty(x.shape, dtype=out_dtype)
        mean, rstd = x.new_empty(rows), x.new_empty(rows)
        ctx.branch_dtype = None if branch is None else branch.dtype
        flags = [int(ctx.branch_dtype == torch.bfloat16), int(out_dtype == torch.bfloat16)]
        ptrs = _ptrs(x, branch, s, weight, bias, y, mean, rstd)
        _norm_kernel(dim).add_norm_forward(*flags, rows, dim, *ptrs, eps, torch.get_num_threads())
        ctx.save_for_backward(s, mean, rstd, weight)
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None
        return s, y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_s, grad_y):  # noqa: D102
        s, mean, rstd, weight = ctx.saved_tensors
        dim, threads = s.shape[-1], torch.get_num_threads()
        grad_y = torch.zeros_like(s) if grad_y is None else grad_y.contiguous()
        grad_s = None if grad_s is None else grad_s.contiguous()
        bf16_branch = ctx.branch_dtype == torch.bfloat16
        grad_x, grad_weight, grad_bias = torch.empty_like(s), s.new_empty(dim), s.new_empty(dim)
        grad_branch = torch.empty(s.shape, dtype=torch.bfloat16) if bf16_branch else None
        partial = s.new_empty(2 * threads * dim)
        flags = [int(grad_y.dtype == torch.bfloat16), int(bf16_branch), s.numel() // dim, dim]
        ptrs = _ptrs(grad_y, grad_s, s, mean, rstd, weight, grad_x, grad_branch)
        ptrs += _ptrs(grad_weight, grad_bias, partial)
        _norm_kernel(dim).add_norm_backward(*flags, *ptrs, threads)
        if not bf16_branch:  # the add passes the gradient through unchanged
            grad_branch = None if ctx.branch_dtype is None else grad_x
        return grad_x, grad_branch, grad_weight, grad_bias, None, None


def native_core(attn, q_src: torch.Tensor, kv_src: torch.Tensor | None = None) -> torch.Tensor:
    """An :data:`~vit_mnist.speed.forward.AttentionCore`: the attention kernel where it
    takes the inputs and a backward follows, the model's own arithmetic otherwise."""
    applies = written_backward_applies(attn, q_src, kv_src)
    if applies and (lib := kernel_for(q_src, kv_src, attn.num_heads)) is not None:
        return FusedCPUAttention.apply(lib, q_src, kv_src, attn.num_heads, attn.scale, attn.causal)
    return reference_core(attn, q_src, kv_src)
