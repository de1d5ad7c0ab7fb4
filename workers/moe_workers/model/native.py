"""The C kernels (`native_decode.c`: the quantized experts' decoder; `native_experts.c`: a decode
step's SwiGLU experts, gpt-oss' among them), built for this machine on first use.

A promotion of an fp8 or mxfp4 expert into a hot slot is a decode, and through torch ops (table
lookups a few rows at a time) it runs at 1.5-4 GB/s of output on the CPUs we measure on, slower
than the disk reads the same expert in bfloat16. The C loops, vectorised for the CPU they run on
(`-O3 -march=native`), decode at several times that. The library is compiled once per source,
compiler and CPU into a private cache directory and loaded with ctypes (no Python extension, no
build step at install); where there is no C compiler, or MOE_NATIVE=0, `library()` is
None and dequant.py keeps its torch decoder, which gives the same bits. `describe()` says which
decoder runs and why, for the shards' status.

Security: the shared object is loaded only from a directory this user owns and nobody else may
write to (0700), and it is written there under a temporary name and renamed, so a half-written
or planted file is never loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("native_decode.c", "native_experts.c", "native_parallel.c"))
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fPIC", "-shared", "-std=gnu11", "-fopenmp")
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C side's OUT_* values
PARALLEL_BYTES = 1 << 20  # outputs at least this large are decoded by several threads
ROWS_MAX = 16  # rows of x a product takes in C at most (a decode step's); beyond, torch's GEMM
ENV_SWITCH, ENV_DIR = "MOE_NATIVE", "MOE_NATIVE_DIR"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None, "why": the reason when None


def _cache_dir() -> Path:
    base = os.environ.get(ENV_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "moe-operator", "native")
    return Path(base)


def _private(d: Path) -> None:
    """Create `d` as 0700 when missing; refuse one another user owns or others may write."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{d} is not private to this user (owner {st.st_uid}, mode {oct(st.st_mode & 0o777)})")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _build(cc: str, d: Path, sources: tuple[Path, ...] = SOURCES, flags: tuple[str, ...] = FLAGS,
           stem: str = "moe_decode") -> Path:
    """The library for these sources, compiler and CPU: cached in `d`, else compiled into it."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [src.read_text() for src in sources]
    key = hashlib.sha256(b"\0".join(s.encode() for s in (*texts, cc, version, _cpu_id(), " ".join(flags))))
    lib = d / f"{stem}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {(done.stderr or done.stdout).strip()[-400:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def build_library(sources: tuple[Path, ...], flags: tuple[str, ...], stem: str) -> tuple[ctypes.CDLL | None, str]:
    """Compile `sources` for this machine (once: cached per source, compiler and CPU in the
    private cache directory) and load them: (library, "") or (None, why not). MOE_NATIVE=0 and a
    missing compiler say None too. The C kernels and the channel's mailboxes (transport/shm.py)
    are built so."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None, f"{ENV_SWITCH}=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc) on this machine"
    try:
        d = _cache_dir()
        _private(d)
        return ctypes.CDLL(str(_build(cc, d, sources, flags, stem))), ""
    except (OSError, RuntimeError, subprocess.SubprocessError, PermissionError) as e:
        return None, f"build failed: {e}"


def _load() -> tuple[ctypes.CDLL | None, str]:
    lib, why = build_library(SOURCES, FLAGS, "moe_decode")
    if lib is None:
        return None, why
    p, n, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    for name, args in (("moe_fp8_par", [p, p, n, n, n, n, p, i, i]), ("moe_mxfp4_par", [p, p, n, p, i, i]),
                       ("moe_swiglu_up_par", [p, p, p, p, n, n, n, p, p, p, i]),
                       ("moe_swiglu_down_par", [p, p, p, n, n, n, p, i]),
                       ("moe_gptoss_up_par", [p, p, p, p, n, n, n, i, f, f, p, p, p, i]),
                       ("moe_gptoss_down_par", [p, p, p, p, n, n, n, i, p, p, i]), ("moe_vecmat_par", [p, p, n, n, p, i]),
                       ("moe_matvec_par", [p, n, n, p, n, p, i])):
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, i
    lib.moe_native_isa.restype = ctypes.c_char_p
    return lib, lib.moe_native_isa().decode()


def library() -> ctypes.CDLL | None:
    """The loaded decoder, built on first call; None where it cannot be (`describe` says why)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, why = _load()
                if lib is None:
                    log.warning("C kernels unavailable (quantized experts decode through torch, "
                                "experts compute through torch): %s", why)
                _state.update(lib=lib, why=why)
    return _state["lib"]  # type: ignore[return-value]


def describe() -> str:
    """"native (avx512)" or "torch (<why not native>)": which decoder runs here."""
    lib = library()
    return f"native ({_state['why']})" if lib is not None else f"torch ({_state['why']})"


def reset() -> None:
    """Forget the loaded library (tests switch the decoder with the environment)."""
    with _lock:
        _state.clear()


def usable(*tensors: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the native decoder can take these: on the CPU, contiguous, a known output dtype."""
    return (out.device.type == "cpu" and out.dtype in KINDS and out.is_contiguous()
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and library() is not None)


def _parts(n: int, nbytes: int) -> int:
    """How many ranges to split n rows or groups into: one per torch thread for a large output,
    else one (the C side runs them on the calling thread's OpenMP team, torch's own)."""
    return max(1, min(torch.get_num_threads() if nbytes >= PARALLEL_BYTES else 1, n))


def _check(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"{what}: the C kernel refused its arguments (code {rc})")


def fp8(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
    """out[i, j] = bits of (E4M3 codes[i, j] x scale[i // b0, j // b1]) in out's dtype (uint8 codes,
    float32 scales, both contiguous; partial edge blocks)."""
    lib, kind = library(), KINDS[out.dtype]
    rows, cols = codes.shape
    s = scale.to(torch.float32).contiguous()
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(s.shape) != grid or tuple(out.shape) != (rows, cols) or codes.element_size() != 1:
        raise ValueError(f"fp8 decode: codes {tuple(codes.shape)}, scales {tuple(s.shape)} (want {grid}), "
                         f"out {tuple(out.shape)}")
    _check(lib.moe_fp8_par(codes.data_ptr(), s.data_ptr(), rows, cols, block[0], block[1], out.data_ptr(), kind,
                           _parts(rows, out.nbytes)), "fp8 decode")
    return out


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [groups x 32 values] from blocks [groups x 16 bytes] and E8M0 scale bytes [groups]."""
    lib, kind = library(), KINDS[out.dtype]
    groups = scales.numel()
    if blocks.numel() != 16 * groups or out.numel() != 32 * groups or blocks.element_size() != 1:
        raise ValueError(f"mxfp4 decode: blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}, "
                         f"out {tuple(out.shape)}")
    _check(lib.moe_mxfp4_par(blocks.data_ptr(), scales.data_ptr(), groups, out.data_ptr(), kind,
                             _parts(groups, out.nbytes)), "mxfp4 decode")
    return out


def _pointers(tensors: list[torch.Tensor]):
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def swiglu_rows(xs: list[torch.Tensor], w1: list[torch.Tensor], w3: list[torch.Tensor], w2: list[torch.Tensor],
                outs: list[torch.Tensor]) -> None:
    """outs[e] = (silu(xs[e] w1[e]^T) * xs[e] w3[e]^T) w2[e]^T for a few bfloat16 rows an expert
    (xs[e] [n_e, hidden], n_e <= ROWS_MAX: a decode step's experts, in one call per phase, each
    weight row read once for all of its expert's rows, the weight rows split across torch's
    threads). Everything bfloat16, contiguous, on the CPU; weights [out, in]."""
    lib, count = library(), len(xs)
    inter, hidden = w1[0].shape
    xs = [x.contiguous() for x in xs]
    rows = [x.shape[0] for x in xs]
    if any(x.dim() != 2 or x.shape[1] != hidden or not 0 < x.shape[0] <= ROWS_MAX for x in xs) or any(
            tuple(o.shape) != tuple(x.shape) or not o.is_contiguous() for o, x in zip(outs, xs)) or len(outs) != count:
        raise ValueError(f"swiglu rows: inputs {[tuple(x.shape) for x in xs]}, outputs "
                         f"{[tuple(o.shape) for o in outs]} (want [1-{ROWS_MAX}, {hidden}] each, outputs alike)")
    gate, up, h = (torch.empty(sum(rows), inter, dtype=torch.bfloat16).split(rows) for _ in range(3))
    p_w1, p_w3, p_w2, p_x, p_out, p_gate, p_up, p_h = (_pointers(t) for t in (w1, w3, w2, xs, outs, gate, up, h))
    p_rows = (ctypes.c_long * count)(*rows)
    nbytes = sum(w.nbytes for w in w1) * 2
    _check(lib.moe_swiglu_up_par(p_w1, p_w3, p_x, p_rows, count, hidden, inter, p_gate, p_up, p_h,
                                 _parts(inter, nbytes)), "swiglu gate/up")
    _check(lib.moe_swiglu_down_par(p_w2, p_h, p_rows, count, inter, hidden, p_out, _parts(hidden, nbytes // 2)),
           "swiglu down")


def gptoss_rows(xs: list[torch.Tensor], gate_up: list[torch.Tensor], gate_up_bias: list[torch.Tensor],
                down: list[torch.Tensor], down_bias: list[torch.Tensor], alpha: float, limit: float, out_in: bool,
                outs: list[torch.Tensor]) -> None:
    """outs[e] = act(xs[e] gate_up[e] + gate_up_bias[e]) down[e] + down_bias[e], gpt-oss' clamped
    SwiGLU (`layers.gpt_oss_expert`: gate and up interleaved in gate_up's outputs), for a few
    bfloat16 rows an expert, in one call per phase as `swiglu_rows`. The weights as the hot tier
    keeps them: [out, in] when `out_in` (decoded from mxfp4), else transformers' [in, out]. Every
    tensor bfloat16, contiguous, on the CPU."""
    lib, count = library(), len(xs)
    hidden = xs[0].shape[1]
    inter = down[0].shape[1] if out_in else down[0].shape[0]
    xs = [x.contiguous() for x in xs]
    rows = [x.shape[0] for x in xs]
    want = ((2 * inter, hidden), (2 * inter,), (hidden, inter), (hidden,)) if out_in else (
        (hidden, 2 * inter), (2 * inter,), (inter, hidden), (hidden,))
    if any(x.dim() != 2 or x.shape[1] != hidden or not 0 < x.shape[0] <= ROWS_MAX for x in xs) or any(
            tuple(o.shape) != tuple(x.shape) or not o.is_contiguous() for o, x in zip(outs, xs)) or len(outs) != count \
            or any(tuple(t.shape) != s for ts in zip(gate_up, gate_up_bias, down, down_bias) for t, s in zip(ts, want)):
        raise ValueError(f"gpt-oss rows: inputs {[tuple(x.shape) for x in xs]}, outputs {[tuple(o.shape) for o in outs]} "
                         f"(want [1-{ROWS_MAX}, {hidden}] each, outputs alike), weights {want} each")
    gu, h = (torch.empty(sum(rows), n, dtype=torch.bfloat16).split(rows) for n in (2 * inter, inter))
    p_gate_up, p_gate_up_bias, p_down, p_down_bias, p_x, p_out, p_gu, p_h = (
        _pointers(t) for t in (gate_up, gate_up_bias, down, down_bias, xs, outs, gu, h))
    p_rows = (ctypes.c_long * count)(*rows)
    # [out, in]: the parts split the outputs (any split gives the same bits); [in, out]: they split
    # the products' sums (W's rows) and add them after, so their number is one expert's (a row's
    # values do not depend on which experts share its call)
    if out_in:
        nbytes = sum(w.nbytes for w in gate_up)
        up_parts, down_parts = _parts(inter, nbytes), _parts(hidden, nbytes // 2)
    else:
        up_parts, down_parts = _parts(hidden, gate_up[0].nbytes), _parts(inter, down[0].nbytes)
    acc = torch.empty(0 if out_in else max(up_parts * 2 * inter, down_parts * hidden) * sum(rows), dtype=torch.float32)
    _check(lib.moe_gptoss_up_par(p_gate_up, p_gate_up_bias, p_x, p_rows, count, hidden, inter, int(out_in), alpha,
                                 limit, p_gu, p_h, acc.data_ptr(), up_parts), "gpt-oss gate/up")
    _check(lib.moe_gptoss_down_par(p_down, p_down_bias, p_h, p_rows, count, inter, hidden, int(out_in), p_out,
                                   acc.data_ptr(), down_parts), "gpt-oss down")


def matvec(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x w^T for w [rows, n] and a few rows x [nx, n], nx <= ROWS_MAX (bfloat16, contiguous,
    on the CPU): a dense projection of a decode step, each row of w read once for all of x, the
    rows of w split across torch's threads; out [nx, rows]."""
    rows, n = w.shape
    x = x.contiguous()
    if x.dim() != 2 or x.shape[1] != n or not 0 < x.shape[0] <= ROWS_MAX or tuple(out.shape) != (x.shape[0], rows) \
            or not out.is_contiguous():
        raise ValueError(f"matvec: w {tuple(w.shape)}, x {tuple(x.shape)}, out {tuple(out.shape)}")
    _check(library().moe_matvec_par(w.data_ptr(), rows, n, x.data_ptr(), x.shape[0], out.data_ptr(),
                                    _parts(rows, w.nbytes)), "matvec")
    return out


def vecmat(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ w for one bfloat16 row x [n] and w [n, m] ([in, out], contiguous): each of torch's
    threads sums the products of a contiguous range of w's rows in float32, then the sums are
    added and rounded once into out [m]."""
    lib = library()
    n, m = w.shape
    x = x.contiguous()
    parts = _parts(n, w.nbytes)
    acc = torch.zeros(parts, m, dtype=torch.float32)  # a part with no rows adds nothing
    _check(lib.moe_vecmat_par(x.data_ptr(), w.data_ptr(), n, m, acc.data_ptr(), parts), "vecmat")
    out.copy_(acc.sum(0) if parts > 1 else acc[0])
    return out
