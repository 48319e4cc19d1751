"""Decode-time paged attention: one call per layer for every decoding sequence.

Each sequence has one query token (its newest, whose K/V are already written) and attends over
its whole context, stored in fixed-size blocks of a shared cache: token ``t`` of sequence ``s``
lives at ``key_cache[block_tables[s, t // block_size], t % block_size]``. This is the decode half
of vLLM's paged attention; like vLLM's CPU backend, the work runs in one C++ kernel
(``csrc/paged_attention.cpp``), compiled on first use with ``torch.utils.cpp_extension.load``;
CUDA tensors over a float pool run our Triton kernel (:mod:`models.triton_attention`).
Where the kernel cannot be built (``SLUICE_DISABLE_CPP_KERNELS=1``, no compiler or ninja, a build
error) or the dtype or device is not one it handles, a pure-torch version gives the same result.

The cache may hold K/V in the query's dtype, in bfloat16 under a float32 query, or in int8 with a
float32 scale per token and kv head (:mod:`models.kv_cache`); the kernel widens rows in registers.
Its hot loops are compiled for AVX-512, AVX2+FMA and the x86-64 baseline; the best the CPU has
runs, unless ``SLUICE_KERNEL_ISA`` (``avx512``, ``avx2``, ``baseline``) names a lower one at load
(tests force the AVX2 path on AVX-512 machines so).

The build lands in ``$SLUICE_CACHE_DIR/torch_extensions`` (default ``~/.cache/sluice``), in a
subfolder per Python, torch and machine so that different environments never load each other's
binaries; later processes only load it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from models import cuda_attention

log = structlog.get_logger(__name__)

DISABLE_ENV = "SLUICE_DISABLE_CPP_KERNELS"
CACHE_DIR_ENV = "SLUICE_CACHE_DIR"
ISA_ENV = "SLUICE_KERNEL_ISA"
EXTENSION_NAME = "sluice_paged_attention"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
SOURCE_PATH = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# Headers the source includes from its own folder (copied beside it for the build).
HEADER_PATHS = tuple(Path(__file__).parent / "csrc" / name for name in ("vec16.h", "paged_attention_checks.h"))
# -O3; -ffp-contract=fast lets the vector loops use FMA (off by default under -std=c++20);
# -fopenmp, because at::parallel_for is a header template that runs serially without it (the
# library resolves to the libgomp torch already loaded, so there is one thread pool); -Wno-psabi
# silences GCC's note on 64-byte vector arguments, which never cross a call boundary. No -march:
# the build cache may serve other CPUs, so the kernel picks its ISA at load time.
CFLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-Wno-psabi"]
LDFLAGS = ["-fopenmp"]
# torch's build lock is a plain file that a process killed mid-build leaves behind, after which
# every later load waits forever; ours is an flock, which the kernel drops with its holder.
_BUILD_LOCK_NAME = "sluice-build.lock"
_TORCH_LOCK_NAME = "lock"
_ERROR_WORDS = ("error", "not found", "No such file")


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV; called once per layer per step.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``, float32, bfloat16 or float16.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
            the dtype of ``query``, bfloat16 under a float32 query, or int8. ``num_heads`` is a
            multiple of ``num_kv_heads``; query head ``h`` reads kv head
            ``h // (num_heads // num_kv_heads)``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32; entries past a sequence's last
            block are ignored.
        context_lens: ``[num_seqs]`` int32, in ``[1, max_blocks_per_seq * block_size]``: the
            tokens each sequence attends to, its current one included.
        scale: multiplies ``q . k`` before the softmax (usually ``head_dim ** -0.5``).
        key_scales, value_scales: with an int8 cache only, ``[num_blocks, block_size,
            num_kv_heads]`` float32, contiguous: K/V row ``x`` stands for ``scale * x``.
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in the dtype of ``query``.
    Raises:
        TypeError: a dtype is wrong. ValueError: a shape, a context length, a block id or the
        presence of the scales is (on CUDA with Triton: shapes and dtypes only, no device reads).

    CUDA tensors over a float pool go to the Triton kernel (:mod:`models.cuda_attention`), CPU
    tensors to the C++ kernel, anything else to :func:`torch_paged_decode_attention`.
    """
    kernels = cuda_attention.triton_for(query, key_cache) if key_scales is None and value_scales is None else None
    if kernels is not None:
        return kernels.triton_paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    if query.dtype in KERNEL_DTYPES and key_cache.dtype in KERNEL_CACHE_DTYPES and query.device.type == "cpu":
        kernel = _KERNEL.module()
        if kernel is not None:
            return kernel.paged_decode_attention(
                query, key_cache, value_cache, block_tables, context_lens, scale, key_scales, value_scales
            )
    return torch_paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, key_scales, value_scales)


def write_kv_rows(
    key_slots: torch.Tensor, value_slots: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Store a step's new K and V rows in one layer's pool.

    Args:
        key_slots, value_slots: ``[num_slots, num_kv_heads, head_dim]`` views of the pool.
        slots: ``[T]`` int64 flat slots, in ``[0, num_slots)``.
        key, value: ``[T, num_kv_heads, head_dim]`` of the pool's dtype.

    The kernel's one call (``write_kv``) on CPU where each token's row is contiguous (a slice of
    the fused QKV product is), else two ``index_copy_``.

    Raises:
        TypeError / ValueError: a dtype, a shape or a slot (from the kernel or torch).
    """
    kernel = _KERNEL.module() if key.device.type == "cpu" else None
    if kernel is not None and _has_contiguous_rows(key) and _has_contiguous_rows(value) and key_slots.is_contiguous():
        kernel.write_kv(key_slots, value_slots, slots, key, value)
        return
    key_slots.index_copy_(0, slots, key)
    value_slots.index_copy_(0, slots, value)


def fused_rope_available() -> bool:
    """Whether :func:`rope_` runs (the kernel is built)."""
    return _KERNEL.module() is not None


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
    """RoPE in place on heads ``[0, num_heads)`` of ``x`` ``[T, H, head_dim]`` float32 (each
    token's row contiguous): Hugging Face's ``x * cos + rotate_half(x) * sin``, ``cos`` and ``sin``
    ``[T, head_dim]`` float32 contiguous. One kernel call (``csrc/paged_attention.cpp``).

    Raises:
        RuntimeError: no kernel (:func:`fused_rope_available`). TypeError / ValueError: dtypes or shapes.
    """
    kernel = _KERNEL.module()
    if kernel is None:
        raise RuntimeError(f"the paged-attention kernel is unavailable: {kernel_unavailable_reason()}")
    kernel.rope_(x, cos, sin, num_heads)


def _has_contiguous_rows(rows: torch.Tensor) -> bool:
    """Whether each ``[num_kv_heads, head_dim]`` row of ``rows`` ``[T, H, D]`` is contiguous."""
    return rows.dim() == 3 and rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]


def compiled_kernel_available() -> bool:
    """Whether :func:`paged_decode_attention` runs the C++ kernel; builds it on the first call."""
    return _KERNEL.module() is not None


def select_isa(name: str = "") -> str:
    """Run the kernel's hot loops at ISA level ``name`` (``avx512``, ``avx2``, ``baseline``; ``""``:
    the best the CPU has) from now on, process-wide; returns the level selected.

    Raises:
        RuntimeError: the C++ kernel is unavailable. ValueError: an unknown level, or one the CPU lacks.
    """
    kernel = _KERNEL.module()
    if kernel is None:
        raise RuntimeError(f"the C++ kernel is unavailable: {_KERNEL.unavailable_reason}")
    return str(kernel.select_isa(name))


def kernel_isa() -> str | None:
    """The ISA level the C++ kernel's hot loops run at (``avx512``, ``avx2``, ``baseline``);
    ``None`` when the kernel is unavailable."""
    kernel = _KERNEL.module()
    return None if kernel is None else str(kernel.isa())


def kernel_unavailable_reason() -> str | None:
    """Why the C++ kernel is not used (``None`` when it is); builds it on the first call."""
    _KERNEL.module()
    return _KERNEL.unavailable_reason


def torch_paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pure-torch fallback of :func:`paged_decode_attention` (same contract, any device).

    Per sequence: one ``index_select`` of its blocks from each cache, then one
    ``scaled_dot_product_attention`` with the query heads of a kv head as its query rows (no GQA
    expansion of K/V), the gathered rows widened (and scaled, for int8) to the query's dtype.
    Measured against one padded, masked batch for all sequences: that gathers tens of MB per call
    into fresh buffers, and their page faults alone cost more than this loop.
    """
    _check_inputs(query, key_cache, value_cache, block_tables, context_lens)
    _check_scales(key_cache, key_scales, value_scales)
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    _check_tables(block_tables, context_lens, block_size, num_blocks)
    group = num_heads // num_kv_heads
    tables = block_tables.long()
    out = torch.empty_like(query)
    for seq, context_len in enumerate(context_lens.tolist()):
        blocks = tables[seq, : -(-context_len // block_size)]
        keys = _gather_rows(key_cache, key_scales, blocks, context_len, query.dtype)
        values = _gather_rows(value_cache, value_scales, blocks, context_len, query.dtype)
        out[seq] = F.scaled_dot_product_attention(
            query[seq].reshape(1, num_kv_heads, group, head_dim),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            scale=scale,
        ).view(num_heads, head_dim)
    return out


def _gather_rows(
    cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, num_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[num_tokens, num_kv_heads, head_dim]`` rows of ``blocks`` in ``dtype`` (int8 rows times their scale)."""
    rows = cache.index_select(0, blocks).flatten(0, 1)[:num_tokens]
    if scales is None:
        return rows.to(dtype)
    return (rows.to(torch.float32) * scales.index_select(0, blocks).flatten(0, 1)[:num_tokens, :, None]).to(dtype)


def _check_scales(key_cache: torch.Tensor, key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> None:
    """The kernel's rule: an int8 cache comes with both float32 scale tensors of its first three dims."""
    is_quantized = key_cache.dtype == torch.int8
    if (key_scales is not None) != is_quantized or (value_scales is not None) != is_quantized:
        raise ValueError(
            "an int8 cache needs key_scales and value_scales" if is_quantized else "key_scales and value_scales go with an int8 cache only"
        )
    for scales in (key_scales, value_scales):
        if scales is not None and (scales.dtype != torch.float32 or scales.shape != key_cache.shape[:3]):
            raise ValueError(f"scales must be float32 of shape {list(key_cache.shape[:3])}, got {scales.dtype} {list(scales.shape)}")


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """The shape and dtype checks of the C++ kernel, with the same exception types."""
    check_query_and_cache(query, key_cache, value_cache)
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError(
            f"block_tables and context_lens must be int32, got {block_tables.dtype} and {context_lens.dtype}"
        )
    num_seqs = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], got shape {list(block_tables.shape)}"
        )
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be [num_seqs={num_seqs}], got shape {list(context_lens.shape)}")


def check_query_and_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The checks every paged-attention kernel shares (shapes and dtypes only, no device reads).

    Raises:
        ValueError: ``query`` is not 3-D, the caches not 4-D of one shape or not contiguous, head
        sizes differ, or ``num_heads`` is not a multiple of ``num_kv_heads``. TypeError: the
        caches' dtype is neither the query's, int8, nor bfloat16 under a float32 query.
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim], got shape {list(query.shape)}")
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {list(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {list(value_cache.shape)} differs from key_cache shape {list(key_cache.shape)}"
        )
    cache_ok = key_cache.dtype in (query.dtype, torch.int8) or (query.dtype, key_cache.dtype) == (torch.float32, torch.bfloat16)
    if not query.is_floating_point() or not cache_ok or value_cache.dtype != key_cache.dtype:
        raise TypeError(
            "query must be floating point and key_cache and value_cache dtypes must match it (or be "
            f"int8, or bfloat16 under a float32 query), got {query.dtype}, {key_cache.dtype} and {value_cache.dtype}"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} differs from the cache's head_dim {key_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")


def _check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_blocks: int) -> None:
    """Context lengths within the table, block ids within the cache (for the blocks in use).

    Skipped while the current CUDA stream is capturing a graph (:mod:`models.cuda_graphs`):
    reading the verdict back is a host sync, which a capture forbids; the captured step's
    inputs come from the runner's own padding (:func:`models.cuda_graphs.pad_decode_inputs`)."""
    if block_tables.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    capacity = block_tables.shape[1] * block_size
    bad_lens = (context_lens < 1) | (context_lens > capacity)
    if bool(bad_lens.any()):
        seq = int(bad_lens.nonzero()[0, 0])
        raise ValueError(
            f"context_lens[{seq}] = {int(context_lens[seq])} is outside "
            f"[1, max_blocks_per_seq * block_size = {capacity}]"
        )
    num_used = (context_lens.unsqueeze(1) + block_size - 1) // block_size
    is_used = torch.arange(block_tables.shape[1], device=block_tables.device) < num_used
    bad_blocks = is_used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad_blocks.any()):
        seq, index = bad_blocks.nonzero()[0].tolist()
        block_id = int(block_tables[seq, index])
        raise ValueError(f"block_tables[{seq}, {index}] = {block_id} is outside [0, num_blocks = {num_blocks})")


class KernelLoader:
    """Builds or loads a C++ extension once per process, on first use, or records why it cannot.

    ``module()`` is safe to call from many threads; the first caller builds while the others wait.
    Any failure (the kill switch ``SLUICE_DISABLE_CPP_KERNELS=1``, no compiler or ninja, a compile
    error) logs one warning and leaves ``module()`` returning ``None``; callers fall back to torch.

    Args:
        build: returns the compiled module; the default compiles ``csrc/paged_attention.cpp``.
        environ: where the kill switch is read (``os.environ`` by default).
    """

    def __init__(
        self, build: Callable[[], ModuleType] | None = None, environ: Mapping[str, str] | None = None, name: str = EXTENSION_NAME
    ):
        self._build = build or build_extension
        self._name = name
        self._environ = os.environ if environ is None else environ
        self._lock = threading.Lock()
        self._is_done = False
        self._module: ModuleType | None = None
        self.unavailable_reason: str | None = None

    def module(self) -> ModuleType | None:
        """The compiled module, or ``None`` when it is disabled or failed to build."""
        if self._is_done:
            return self._module
        with self._lock:
            if not self._is_done:
                self._module = self._load()
                self._is_done = True
        return self._module

    def _load(self) -> ModuleType | None:
        if self._environ.get(DISABLE_ENV, "") not in ("", "0"):
            self.unavailable_reason = f"disabled by {DISABLE_ENV}={self._environ[DISABLE_ENV]}"
        else:
            try:
                return self._build()
            except Exception as exc:  # noqa: BLE001 - any build failure means the torch fallback
                self.unavailable_reason = f"build failed: {type(exc).__name__}: {_summary(exc)}"
        log.warning("cpp_kernel_unavailable", kernel=self._name, reason=self.unavailable_reason, fallback="torch")
        return None


def build_directory(
    source_path: Path = SOURCE_PATH, flags: list[str] = CFLAGS + LDFLAGS, header_paths: tuple[Path, ...] = HEADER_PATHS
) -> Path:
    """``$SLUICE_CACHE_DIR/torch_extensions/<python>_<torch>_<machine>_<source hash>`` (cache dir
    default ``~/.cache/sluice``). The hash covers the kernel's source, its headers and flags, so
    every checkout of the same kernel shares one build, wherever it lies."""
    root = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "sluice")
    sources = b"".join(path.read_bytes() for path in (source_path, *header_paths))
    digest = hashlib.sha256(sources + " ".join(flags).encode()).hexdigest()[:12]
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_{platform.machine()}_{digest}"
    return root / "torch_extensions" / tag


def build_extension(
    name: str = EXTENSION_NAME,
    source_path: Path = SOURCE_PATH,
    cflags: list[str] = CFLAGS,
    ldflags: list[str] = LDFLAGS,
    header_paths: tuple[Path, ...] = HEADER_PATHS,
    choose_isa: bool = True,
) -> ModuleType:
    """Compile (or reuse the cached build of) a kernel (this module's by default: its source and
    ``header_paths``) and import it; raises on any failure. With ``choose_isa``, the module's
    ``select_isa`` is called with ``$SLUICE_KERNEL_ISA`` (the paged-attention kernel's levels).

    Logs ``kernel_build_started`` and ``kernel_build_finished`` with ``duration_s`` and
    ``cached`` (the binary was already built: only loaded), the first build on a machine takes
    about a minute on two cores.
    """
    import fcntl

    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    directory = build_directory(source_path, cflags + ldflags, header_paths)
    directory.mkdir(parents=True, exist_ok=True)
    binary = directory / f"{name}.so"
    source = directory / source_path.name
    built_before = binary.stat().st_mtime_ns if binary.exists() else None
    log.info("kernel_build_started", kernel=name, build_directory=str(directory))
    started = time.perf_counter()
    with open(directory / _BUILD_LOCK_NAME, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        # Holding our lock, no other process is inside load(): a torch lock file is a leftover.
        (directory / _TORCH_LOCK_NAME).unlink(missing_ok=True)
        # torch's build file names its sources by absolute path: build from a copy inside the
        # directory, so a checkout elsewhere finds the same build file and reuses the binary.
        for path in (source_path, *header_paths):
            copy = directory / path.name
            if not copy.exists() or copy.read_bytes() != path.read_bytes():
                shutil.copyfile(path, copy)
        with _torch_build_logs_quiet():
            module: Any = load(
                name=name,
                sources=[str(source)],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(directory),
                verbose=False,
            )
    is_cached = built_before is not None and binary.stat().st_mtime_ns == built_before
    isa = module.select_isa(os.environ.get(ISA_ENV, "")) if choose_isa else None
    log.info("kernel_build_finished", kernel=name, cached=is_cached, isa=isa, duration_s=round(time.perf_counter() - started, 3))
    return module


def _put_ninja_on_path() -> None:
    """torch's build runs ``ninja`` from ``PATH``; a server started as ``.venv/bin/python`` may not
    have the venv's ``bin`` there, so add the ``ninja`` package's binary folder when needed."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _summary(exc: BaseException) -> str:
    """One line for the warning: the error's headline (without the compile command) and the first
    line of the compiler's output that says what went wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["no message"]
    headline = lines[0].split(": [", 1)[0][:200]
    detail = next((line for line in lines[1:] if any(word in line for word in _ERROR_WORDS)), None)
    return f"{headline}: {detail[:300]}" if detail else headline


@contextlib.contextmanager
def _torch_build_logs_quiet() -> Iterator[None]:
    """Keep torch's own build warnings (compiler version checks) out of the log: a failure is
    reported once, by :class:`KernelLoader`."""
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch_log.setLevel(level)


_KERNEL = KernelLoader()
