"""The C++ kernels of the ``native`` speed paths (``attention_cpu.cpp``,
``layer_norm_cpu.cpp``): building, loading and autograd.

- Attention: softmax(Q K^T * scale) V and its backward for all heads of an image in one
  kernel call (:class:`FusedCPUAttention`), where PyTorch takes a dozen operations.
- Residual add + LayerNorm (:func:`add_norm`): one pass each way where PyTorch takes four
  (cast, add, LayerNorm, cast).

Both are built for the instruction-set class PyTorch's own kernels run at here
(:func:`build_target`): the attention kernel for AVX-512 (16-float vectors; ``vdpbf16ps``
where the CPU has AVX512-BF16) or for AVX2 (8-float vectors), the LayerNorm kernel for
AVX-512 only (elsewhere PyTorch's add and LayerNorm run: an 8-float build of it made the
AVX2 training step no faster, docs/speed.md). :mod:`vit_mnist.speed.paths`
offers the ``native`` path on those classes, and ``speed.path=auto`` takes it only where
it measures fastest (docs/speed.md has the figures of both classes).

Each kernel is compiled on first use with the system's C++ compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``) for this CPU (``-march=native``, without AVX-512 where PyTorch runs
at AVX2, as under ``ATEN_CPU_CAPABILITY=avx2``) and OpenMP, then cached under
``$VIT_MNIST_CACHE/kernels`` (default ``~/.cache/vit_mnist/kernels``), one library per
shape class, about 1 s each. Where a kernel cannot take an input (a sequence longer than
128 tokens, a head wider than 64, float16) the path runs that step on PyTorch operations,
with the same numbers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from vit_mnist.io import atomic_write_bytes
from vit_mnist.speed import cache_root
from vit_mnist.speed.hardware import cpuinfo_flags, isa_class

SOURCE = Path(__file__).with_name("attention_cpu.cpp")
MAX_TOKENS = 128  # queries and keys: the kernel's per-thread buffers hold 128 rows
MAX_HEAD_DIM = 64
FLAGS = ("-std=c++17", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# Per build target (build_target()): the flags added to FLAGS, and the attention kernel's
# vector width in floats.
TARGET_FLAGS = {"AVX-512": (), "AVX2": ("-mno-avx512f",)}
LANES = {"AVX-512": 16, "AVX2": 8}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
FAILURES: dict[str, str] = {}  # library stem -> why its build or load failed in this process


def _compiler() -> str | None:
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((p for c in ("c++", "g++", "clang++") if (p := shutil.which(c))), None)


def _cpu_identity() -> str:
    # -march=native code is for this CPU only: a cache shared between machines (an NFS home)
    # must not hand one CPU's build to another.
    flags = cpuinfo_flags()
    return " ".join(sorted(flags)) if flags else f"{platform.machine()} {platform.processor()}"


def build_target() -> str | None:
    """What the kernels are built for here: ``"AVX-512"`` where PyTorch's own CPU kernels run
    AVX-512, ``"AVX2"`` where they run AVX2 (an AVX2 CPU, or an AVX-512 one under
    ``ATEN_CPU_CAPABILITY=avx2``), else None (no kernel: ARM, or an older x86)."""
    isa = isa_class()
    if isa in ("AVX-512", "AVX512-BF16", "AMX"):
        return "AVX-512"
    return "AVX2" if isa == "AVX2" else None


def lanes() -> int:
    """The attention kernel's vector width in floats for :func:`build_target`: 16 or 8. Its
    saved weights' rows are padded to a multiple of it."""
    return LANES.get(build_target(), 8)


def cache_dir() -> Path:
    """Where built kernels are kept: ``cache_root()/kernels`` (``$VIT_MNIST_CACHE``, default
    ``~/.cache/vit_mnist``)."""
    return cache_root() / "kernels"


def _build(source: Path, defines: tuple[str, ...], stem: str) -> Path:
    """Compile ``source`` with ``FLAGS`` and ``defines`` (further flags) into
    ``cache_dir()/<stem>_<hash>.so``; returns the library's path. Raises RuntimeError (why)
    on failure."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), cxx, version, *FLAGS, *defines, _cpu_identity()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{stem}_{key}.so"
    if target.exists():
        return target
    # A build that failed is remembered, keyed as the library (the compiler, its version,
    # the flags, this CPU): later runs neither retry it nor pay for the compiler again.
    failed = target.with_suffix(".failed")
    if failed.is_file():
        why = failed.read_text().strip()
        raise RuntimeError(f"{why} (an earlier build; delete {failed} to retry)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compiled to a temporary name and renamed: a reader never sees a half-written library,
    # and two processes building at once (DDP) each rename a complete one.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [cxx, *FLAGS, *defines, str(source), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            why = f"{cxx} failed: {done.stderr.strip()[-500:]}"
            with contextlib.suppress(OSError):  # unremembered, the compiler's reason still shows
                atomic_write_bytes(failed, why.encode())
            raise RuntimeError(why)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(source: Path, defines: tuple[str, ...], stem: str, fallback: str) -> ctypes.CDLL | None:
    """The library built from ``source``, or None (with a warning that says ``fallback``)."""
    if not torch.backends.openmp.is_available():
        return None  # the kernel's threads would not be torch's
    try:
        return ctypes.CDLL(str(_build(source, defines, stem)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        FAILURES[stem] = str(e)
        warnings.warn(f"vit_mnist: {fallback} ({e})", RuntimeWarning, stacklevel=4)
        return None


def build_failure(tokens: int, head_dim: int) -> str | None:
    """Why the attention kernel for sequences of ``tokens`` and heads of ``head_dim``
    features cannot be built or loaded here (building it now if need be), or None where it
    can, or where such inputs run on PyTorch operations by design (longer than
    ``MAX_TOKENS``, wider than ``MAX_HEAD_DIM``). Emits no warning: the caller says it."""
    if not (1 <= tokens <= MAX_TOKENS and 1 <= head_dim <= MAX_HEAD_DIM):
        return None
    blocks, vectors = _shape_class(tokens, head_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if _library(blocks, vectors) is not None:
            return None
    return FAILURES.get(_attention_stem(blocks, vectors), "the kernel library could not be loaded")


def _attention_stem(blocks: int, vectors: int) -> str:
    """The attention library's file-name stem for a shape class (and its FAILURES key)."""
    return f"attention_cpu_{blocks}x{vectors}"


def _library(blocks: int, vectors: int) -> ctypes.CDLL | None:
    return _target_library(blocks, vectors, build_target())


@functools.cache
def _target_library(blocks: int, vectors: int, target: str | None) -> ctypes.CDLL | None:
    if target is None:
        return None
    lib = _load(
        SOURCE,
        (*TARGET_FLAGS[target], f"-DATTN_NB={blocks}", f"-DATTN_DV={vectors}"),
        _attention_stem(blocks, vectors),
        "the fused CPU attention kernel is not available; the explicit attention path runs "
        "on PyTorch operations instead (same numbers, slower)",
    )
    if lib is None or lib.attn_lanes() != LANES[target]:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.attn_forward.argtypes = [ctypes.c_int, *[ptr, i64, i64] * 4, ptr, *[i64] * 5]
    lib.attn_forward.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.attn_backward.argtypes = [ctypes.c_int, *[ptr, i64, i64] * 3, ptr, *[ptr, i64, i64] * 4]
    lib.attn_backward.argtypes += [*[i64] * 5, ctypes.c_float, ctypes.c_int]
    lib.attn_forward.restype = lib.attn_backward.restype = None
    return lib


def _split(q_src: torch.Tensor, kv_src: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
    """The keys' and values' tensor, the model width D and the keys' column offset."""
    kv = q_src if kv_src is None else kv_src
    dim = kv.shape[-1] // (3 if kv_src is None else 2)
    return kv, dim, dim if kv_src is None else 0


def _ready(dtype: torch.dtype, t_q: int, t_k: int, head_dim: int) -> bool:
    return (
        dtype in _DTYPES
        and 1 <= t_q <= MAX_TOKENS
        and 1 <= t_k <= MAX_TOKENS
        and 1 <= head_dim <= MAX_HEAD_DIM
        and _library(*_shape_class(t_k, head_dim)) is not None
    )


def _shape_class(t_k: int, head_dim: int, width: int | None = None) -> tuple[int, int]:
    """(key blocks, vectors per head row) of ``width`` floats each (default :func:`lanes`)."""
    width = width or lanes()
    vectors = -(-head_dim // width)
    return -(-t_k // width), 4 if vectors == 3 else vectors


def usable(q_src: torch.Tensor, kv_src: torch.Tensor | None, num_heads: int) -> bool:
    """Whether the kernel takes these inputs (it is built on the first call that asks).

    ``q_src``: the packed projection (B, T, 3*D) when ``kv_src`` is None, else the queries
    (B, T_q, D) with ``kv_src`` the keys and values (B, T_k, 2*D).
    """
    kv, dim, _ = _split(q_src, kv_src)
    tensors = (q_src,) if kv_src is None else (q_src, kv_src)
    return (
        all(t.device.type == "cpu" and t.dim() == 3 and t.stride(-1) == 1 for t in tensors)
        and kv.dtype == q_src.dtype
        and _ready(q_src.dtype, q_src.shape[1], kv.shape[1], dim // num_heads)
    )


def kernel_for(
    q_src: torch.Tensor, kv_src: torch.Tensor | None, num_heads: int
) -> ctypes.CDLL | None:
    """The built kernel for these inputs (see :func:`usable`), or None where it does not
    apply."""
    if not usable(q_src, kv_src, num_heads):
        return None
    kv, dim, _ = _split(q_src, kv_src)
    return _library(*_shape_class(kv.shape[1], dim // num_heads))


def _rows(t: torch.Tensor, offset: int = 0) -> list[int]:
    """A pointer to element ``offset`` of row 0, and the batch and token strides (elements)."""
    return [t.data_ptr() + offset * t.element_size(), t.stride(0), t.stride(1)]


def _kernel(q_src: torch.Tensor, kv_src: torch.Tensor | None, num_heads: int) -> ctypes.CDLL:
    lib = kernel_for(q_src, kv_src, num_heads)
    if lib is None:
        raise RuntimeError("the fused CPU attention kernel cannot take these inputs")
    return lib


def _kv_rows(t: torch.Tensor, k_off: int, dim: int) -> list[int]:
    """:func:`_rows` of the keys' columns of ``t``, then of the values' (``dim`` later)."""
    return [*_rows(t, k_off), *_rows(t, k_off + dim)]


def _sizes(q_src: torch.Tensor, kv: torch.Tensor, dim: int, num_heads: int) -> list[int]:
    """B, h, T_q, T_k and head_dim, as both entry points of the kernel take them."""
    return [q_src.shape[0], num_heads, q_src.shape[1], kv.shape[1], dim // num_heads]


def _forward(q_src, kv_src, num_heads: int, scale: float, causal: bool):
    """The kernel's forward: (output (B, T_q, D), weights (B*h, T_q, T_k rounded up to a
    multiple of :func:`lanes`)). Inputs as :class:`FusedCPUAttention`; RuntimeError where
    the kernel cannot take them (check :func:`usable` first)."""
    lib = _kernel(q_src, kv_src, num_heads)
    kv, dim, k_off = _split(q_src, kv_src)
    b, t_q = q_src.shape[:2]
    out = q_src.new_empty(b, t_q, dim)
    width = lanes()
    weights = q_src.new_empty(b * num_heads, t_q, -(-kv.shape[1] // width) * width)
    lib.attn_forward(
        _DTYPES[q_src.dtype],
        *_rows(q_src),
        *_kv_rows(kv, k_off, dim),
        *_rows(out),
        weights.data_ptr(),
        *_sizes(q_src, kv, dim, num_heads),
        scale,
        int(causal),
        torch.get_num_threads(),
    )
    return out, weights


def _backward(grad_out, q_src, kv_src, weights, num_heads: int, scale: float):
    """The kernel's backward: the gradients of ``q_src`` and of ``kv_src`` (None for the
    packed form, whose one gradient is laid out as the qkv projection's output)."""
    lib = _kernel(q_src, kv_src, num_heads)
    kv, dim, k_off = _split(q_src, kv_src)
    grad_out = grad_out.contiguous()
    grad_q_src = torch.empty_like(q_src)
    grad_kv_src = None if kv_src is None else torch.empty_like(kv_src)
    grad_kv = grad_q_src if kv_src is None else grad_kv_src
    lib.attn_backward(
        _DTYPES[q_src.dtype],
        *_rows(q_src),
        *_kv_rows(kv, k_off, dim),
        weights.data_ptr(),
        *_rows(grad_out),
        *_rows(grad_q_src),
        *_kv_rows(grad_kv, k_off, dim),
        *_sizes(q_src, kv, dim, num_heads),
        scale,
        torch.get_num_threads(),
    )
    return grad_q_src, grad_kv_src


class FusedCPUAttention(torch.autograd.Function):
    """softmax(Q K^T * scale) V for all heads, forward and backward in the C++ kernel.

    Inputs: ``q_src`` (B, T, 3*D) is the qkv projection, Q, K and V side by side and heads
    within each (as ``MultiHeadSelfAttention.qkv`` makes it), when ``kv_src`` is None;
    otherwise ``q_src`` (B, T_q, D) holds the queries and ``kv_src`` (B, T_k, 2*D) the keys
    and values. float32 or bfloat16, last dimension contiguous; :func:`usable` must be
    true. Query i is token i, for the causal mask.

    Output: (B, T_q, D), heads concatenated (``Concat(head_1..head_h)``, ready for W^O).
    Saves the weights (B*h, T_q, T_k rounded up to a multiple of :func:`lanes`) in the
    inputs' dtype for backward.
    """

    @staticmethod
    def forward(ctx, q_src, kv_src, num_heads: int, scale: float, causal: bool):  # noqa: D102
        out, weights = _forward(q_src, kv_src, num_heads, scale, causal)
        ctx.save_for_backward(q_src, kv_src, weights)
        ctx.meta = (num_heads, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        q_src, kv_src, weights = ctx.saved_tensors
        num_heads, scale = ctx.meta
        grad_q_src, grad_kv_src = _backward(grad_out, q_src, kv_src, weights, num_heads, scale)
        return grad_q_src, grad_kv_src, None, None, None


# The residual add and the LayerNorm after it (layer_norm_cpu.cpp).

NORM_SOURCE = Path(__file__).with_name("layer_norm_cpu.cpp")
MAX_NORM_DIM = 256  # a row of up to 16 vectors stays in registers


@functools.cache
def _norm_library(vectors: int, target: str | None) -> ctypes.CDLL | None:
    if target != "AVX-512":
        return None  # AVX-512 intrinsics; at AVX2 a build of it did not pay (module docstring)
    lib = _load(
        NORM_SOURCE,
        (*TARGET_FLAGS[target], f"-DLN_NV={vectors}"),
        f"layer_norm_cpu_{vectors}",
        "the fused CPU residual-add-and-LayerNorm kernel is not available; PyTorch's add "
        "and LayerNorm run instead (the same numbers to float32 rounding, slower)",
    )
    if lib is None or not lib.add_norm_available():
        return None  # no AVX-512: the library was built, but holds no kernel
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.add_norm_forward.argtypes = [i32, i32, i64, i64, *[ptr] * 8, ctypes.c_float, i32]
    lib.add_norm_backward.argtypes = [i32, i32, i64, i64, *[ptr] * 11, i32]
    lib.add_norm_forward.restype = lib.add_norm_backward.restype = None
    return lib


def _norm_kernel(dim: int) -> ctypes.CDLL | None:
    """The library for rows of ``dim`` floats (built for that many 16-float vectors)."""
    return _norm_library(-(-dim // 16), build_target())


def _norm_ready(dim: int) -> bool:
    return 1 <= dim <= MAX_NORM_DIM and _norm_kernel(dim) is not None


def add_norm_usable(x: torch.Tensor, branch: torch.Tensor | None, norm: torch.nn.LayerNorm) -> bool:
    """Whether :func:`add_norm` takes these inputs: a float32 CPU residual stream ``x``
    (..., D) with D <= 256, contiguous; ``branch`` None or of ``x``'s shape, float32 or
    bfloat16; a LayerNorm over D with weight and bias; an AVX-512 CPU (the kernel is built
    on the first call that asks). Always False under jit tracing, and while
    ``torch.compile`` or ``torch.export`` traces (no compiled path calls the kernels).
    """
    dim = x.shape[-1]
    return (
        not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() >= 2
        and x.is_contiguous()
        and (
            branch is None
            or (
                branch.shape == x.shape
                and branch.device.type == "cpu"
                and branch.dtype in (torch.float32, torch.bfloat16)
            )
        )
        and tuple(norm.normalized_shape) == (dim,)
        and norm.weight is not None
        and norm.bias is not None
        and norm.weight.dtype == norm.bias.dtype == torch.float32
        and _norm_ready(dim)
    )


def add_norm(
    x: torch.Tensor, branch: torch.Tensor | None, norm: torch.nn.LayerNorm, *, for_linear: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + branch`` (``x`` when ``branch`` is None) and ``norm(s)``, in one pass each
    way (forward and backward) of the C++ kernel; :func:`add_norm_usable` must be true.

    Shapes and dtypes: ``x`` (..., D) float32, ``branch`` as ``x``, float32 or bfloat16;
    returns ``s`` (..., D) float32 and ``norm(s)`` (..., D). With ``for_linear`` and bf16
    autocast on for the CPU, ``norm(s)`` comes already rounded to bfloat16: the values
    that autocast's cast before a Linear would give it. Otherwise float32.

    The same numbers as PyTorch's add and LayerNorm to float32 rounding: the statistics are
    summed in another order (two-pass, where PyTorch uses Welford's update).
    """
    bf16_out = (
        for_linear
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
    )
    out_dtype = torch.bfloat16 if bf16_out else torch.float32
    with torch.autocast("cpu", enabled=False):
        return AddLayerNorm.apply(x, branch, norm.weight, norm.bias, norm.eps, out_dtype)


def _contiguous_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


class AddLayerNorm(torch.autograd.Function):
    """``(x + branch, LayerNorm(x + branch))`` in the C++ kernel; see :func:`add_norm`.

    Saves ``s = x + branch`` (float32) and the rows' mean and 1/std for the backward, as
    PyTorch's LayerNorm saves its input and the same statistics.
    """

    @staticmethod
    def forward(ctx, x, branch, weight, bias, eps: float, out_dtype: torch.dtype):  # noqa: D102
        dim = x.shape[-1]
        rows = x.numel() // dim
        branch = _contiguous_or_none(branch)
        s = torch.empty_like(x)
        y = torch.empty(x.shape, dtype=out_dtype)
        mean, rstd = x.new_empty(rows), x.new_empty(rows)
        _norm_kernel(dim).add_norm_forward(
            int(branch is not None and branch.dtype == torch.bfloat16),
            int(out_dtype == torch.bfloat16),
            rows,
            dim,
            x.data_ptr(),
            None if branch is None else branch.data_ptr(),
            s.data_ptr(),
            weight.data_ptr(),
            bias.data_ptr(),
            y.data_ptr(),
            mean.data_ptr(),
            rstd.data_ptr(),
            eps,
            torch.get_num_threads(),
        )
        ctx.save_for_backward(s, mean, rstd, weight)
        ctx.branch_dtype = None if branch is None else branch.dtype
        # An output nobody used arrives in backward as None, not as zeros to read.
        ctx.set_materialize_grads(False)
        return s, y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_s, grad_y):  # noqa: D102
        s, mean, rstd, weight = ctx.saved_tensors
        dim = s.shape[-1]
        rows = s.numel() // dim
        if grad_y is None:
            grad_y = torch.zeros_like(s)
        grad_y, grad_s = grad_y.contiguous(), _contiguous_or_none(grad_s)
        threads = torch.get_num_threads()
        grad_x = torch.empty_like(s)
        bf16_branch = ctx.branch_dtype == torch.bfloat16
        grad_branch = torch.empty(s.shape, dtype=torch.bfloat16) if bf16_branch else None
        grad_weight, grad_bias = s.new_empty(dim), s.new_empty(dim)
        partial = s.new_empty(2 * threads * dim)
        _norm_kernel(dim).add_norm_backward(
            int(grad_y.dtype == torch.bfloat16),
            int(bf16_branch),
            rows,
            dim,
            grad_y.data_ptr(),
            None if grad_s is None else grad_s.data_ptr(),
            s.data_ptr(),
            mean.data_ptr(),
            rstd.data_ptr(),
            weight.data_ptr(),
            grad_x.data_ptr(),
            None if grad_branch is None else grad_branch.data_ptr(),
            grad_weight.data_ptr(),
            grad_bias.data_ptr(),
            partial.data_ptr(),
            threads,
        )
        if ctx.branch_dtype is None:
            grad_branch = None
        elif not bf16_branch:
            grad_branch = grad_x  # the add passes the gradient through unchanged
        return grad_x, grad_branch, grad_weight, grad_bias, None, None
