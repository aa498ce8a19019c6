"""C++ CPU backend of the fused linear log-prob: the ATen + OpenMP kernels of `csrc/`, registered
as the custom ops `torch.ops.fgrpo.logprob_fwd` / `torch.ops.fgrpo.logprob_bwd`.

Built lazily on first use with `torch.utils.cpp_extension` (ninja) into the torch extensions
cache (`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`). The build directory is
keyed by a hash of the sources, the compiler flags and the install location (the C++ sources'
directory and torch's), so two checkouts or venvs on one machine never rebuild over each other,
and a finished build is loaded as it is (no ninja run, whatever the files' mtimes say). Every
build prints one line: why it runs and how long it took. Same signatures as `chunked.py`; fp64
inputs go to the chunked path (the kernels multiply in fp32). Fake kernels are registered here
so `torch.compile` can trace the ops.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from ...core.options import LogProbOptions
from . import chunked
from .chunked import unsupported  # noqa: F401 - the same for both CPU backends

SOURCES = ("ops.cpp", "logprob_fwd.cpp", "logprob_bwd.cpp", "logits_chunk.cpp", "tiles.cpp")
HEADERS = ("logprob.h",)
_state: dict[str, Exception | None] = {}


def csrc_dir() -> Path:
    """The C++ sources: `csrc/`, installed as package data `fgrpo_kernels._csrc` (a wheel or
    an editable install), else the repository checkout that holds this package."""
    try:
        from importlib.resources import files

        installed = Path(str(files("fgrpo_kernels._csrc")))
        if (installed / SOURCES[0]).is_file():
            return installed
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[3] / "csrc"


def _isa() -> tuple[str, list[str]]:
    """Vector ISA of this host as (tag, flags); the tag keeps a shared cache host-correct."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2", [
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-DCPU_CAPABILITY=AVX2",
            "-DCPU_CAPABILITY_AVX2",
        ]
    return "default", ["-DCPU_CAPABILITY=DEFAULT"]


def _flags(isa_flags: list[str]) -> list[str]:
    return ["-O3", "-fopenmp", "-DNDEBUG", *isa_flags]


def build_info(src: Path, tag: str, flags: list[str]) -> dict[str, str]:
    """What a build depends on: the sources' hash, the flags, torch, Python and where the
    sources and torch are installed. Equal infos build the same library."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    return {
        "sources": digest.hexdigest()[:16],
        "flags": " ".join(flags),
        "isa": tag,
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "csrc": str(src.resolve()),
        "torch_dir": str(Path(torch.__file__).resolve().parent),
    }


def extensions_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return Path(root)


def build_directory(tag: str, info: dict[str, str]) -> Path:
    """`<extensions root>/fgrpo_cpu_<isa>_py<XY>_torch<version>_<hash of info>`."""
    version = torch.__version__.replace(".", "_").replace("+", "_")
    py = "py" + info["python"].replace(".", "")
    key = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:12]
    return extensions_root() / f"fgrpo_cpu_{tag}_{py}_torch{version}_{key}"


MARKER = "build.json"  # written into the build directory once its library is complete


def rebuild_reason(build_dir: Path, info: dict[str, str]) -> str:
    """Why `build_dir` has no finished library: compared with the other finished builds."""
    if build_dir.exists():
        return "an earlier build in this directory did not finish"
    earlier = []
    for marker in build_dir.parent.glob(f"fgrpo_cpu_*/{MARKER}"):
        try:
            earlier.append(json.loads(marker.read_text()))
        except (OSError, ValueError):
            continue
    here = [e for e in earlier if e.get("csrc") == info["csrc"]]
    if not here:
        return f"first build for the sources in {info['csrc']}"
    for keys, why in (
        (("torch", "torch_dir", "python"), "the C++ sources changed"),
        (("sources", "flags", "isa"), f"another torch or Python (torch {info['torch']})"),
    ):
        if any(all(e.get(k) == info[k] for k in keys) for e in here):
            return why
    return "another torch, Python or compiler flags, and the C++ sources changed"


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    tag, isa_flags = _isa()
    name = f"fgrpo_cpu_{tag}"
    src = csrc_dir()
    if not (src / SOURCES[0]).is_file():
        raise FileNotFoundError(f"C++ sources not found in {src}")
    flags = _flags(isa_flags)
    info = build_info(src, tag, flags)
    build_dir = build_directory(tag, info)
    library, marker = build_dir / f"{name}.so", build_dir / MARKER
    if library.is_file() and marker.is_file():
        # NB: the directory's key is the hash of everything the library depends on; loading it
        # directly skips ninja, which would rebuild on a newer mtime alone (a git checkout).
        _load_library(library)
        _register_fakes()
        return
    reason = rebuild_reason(build_dir, info)
    print(
        f"fgrpo_kernels: building the C++ CPU backend ({reason}) in {build_dir} ...",
        end="",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    outcome = "failed after"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(src / f) for f in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        seconds = time.perf_counter() - start
        _state["built_s"] = seconds
        marker.write_text(json.dumps({**info, "seconds": round(seconds, 1)}, indent=1) + "\n")
        outcome = "done in"
    finally:
        print(f" {outcome} {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    _register_fakes()


def _register_fakes() -> None:
    @torch.library.register_fake("fgrpo::logprob_fwd")
    def _(
        hidden, weight, targets, bias, temperature, ignore_index, return_entropy,
        vocab_start=0, vocab_total=-1,
    ):  # fmt: skip
        n = hidden.shape[0]
        out = [hidden.new_empty(n, dtype=torch.float32) for _ in range(2)]
        return (*out, hidden.new_empty(n if return_entropy else 0, dtype=torch.float32))

    @torch.library.register_fake("fgrpo::logprob_bwd")
    def _(
        hidden,
        weight,
        targets,
        bias,
        lse,
        entropy,
        grad_logp,
        grad_entropy,
        temperature,
        ignore_index,
        need_hidden,
        need_weight,
        need_bias,
        vocab_start=0,
        vocab_total=-1,
    ):
        need_bias = need_bias and bias is not None
        return (
            torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            torch.empty_like(bias) if need_bias else hidden.new_empty(0, dtype=torch.float32),
        )

    @torch.library.register_fake("fgrpo::logits_fwd")
    def _(hidden, weight, targets, bias, temperature, ignore_index, return_entropy, logits):
        n = hidden.shape[0]
        out = [hidden.new_empty(n, dtype=torch.float32) for _ in range(2)]
        return (*out, hidden.new_empty(n if return_entropy else 0, dtype=torch.float32))

    @torch.library.register_fake("fgrpo::logits_bwd")
    def _(logits, hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy,
          temperature, ignore_index, dh, dw, db, accumulate, fold_w=None, fold_b=None,
          fold_alpha=1.0):  # fmt: skip
        return None


def constant_under_compile(fn):
    """Mark `fn` as `torch.compiler.assume_constant_result` does (torch.compile calls it eagerly
    and keeps its result, so it never traces the build), without that function's import of
    torch._dynamo. This module loads on the first fused call, usually after
    init_process_group, and torch._dynamo imported then pulls in torch.distributed.nn.functional,
    whose default arguments (group=group.WORLD) keep the default process group alive past
    destroy_process_group: its gloo threads then die at interpreter exit, sometimes with SIGABRT.
    tests/test_distributed.py checks that no fused call keeps a group alive, and
    tests/test_cpp_backend.py that the mark is the one torch's decorator sets."""
    fn._dynamo_marked_constant = True
    return fn


@constant_under_compile
def available() -> bool:
    """Build (first use) and load the ops, once per process; whether that worked."""
    if "error" not in _state:
        try:
            _build_and_load()
            _state["error"] = None
        except Exception as error:  # noqa: BLE001 - any build failure means: use the fallback
            _state["error"] = error
    return _state["error"] is None


def build_seconds() -> float | None:
    """How long this process spent building the library (None: it was loaded, not built)."""
    return _state.get("built_s")


def build_error() -> Exception | None:
    """Why the build failed (None if it worked or was not tried)."""
    return _state.get("error")


def _wide(*tensors) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in tensors)


def _vocab_range(opts: LogProbOptions) -> tuple[int, int]:
    """The ops' (vocab_start, vocab_total) arguments; −1: the weight's own V."""
    return opts.vocab_start, -1 if opts.vocab_total is None else opts.vocab_total


def logprob_fwd(hidden, weight, targets, bias, opts: LogProbOptions, return_entropy: bool):
    """hidden [N, H], weight [V, H], targets [N] → (logp [N], lse [N], entropy [N] | None), fp32."""
    if _wide(hidden, weight):
        return chunked.logprob_fwd(hidden, weight, targets, bias, opts, return_entropy)
    logp, lse, entropy = torch.ops.fgrpo.logprob_fwd(
        hidden, weight, targets, bias, opts.temperature, opts.ignore_index, return_entropy,
        *_vocab_range(opts),
    )  # fmt: skip
    return logp, lse, entropy if return_entropy else None


def logprob_bwd(
    hidden,
    weight,
    targets,
    bias,
    lse,
    entropy,
    grad_logp,
    grad_entropy,
    opts: LogProbOptions,
    needs: tuple[bool, bool, bool],
):
    """Gradients (dhidden, dweight, dbias) of Σ g·logp + Σ g_H·entropy; None where not needed."""
    if _wide(hidden, weight):
        return chunked.logprob_bwd(
            hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy, opts, needs
        )
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    dh, dw, db = torch.ops.fgrpo.logprob_bwd(
        hidden,
        weight,
        targets,
        bias,
        lse,
        entropy,
        grad_logp,
        grad_entropy,
        opts.temperature,
        opts.ignore_index,
        need_h,
        need_w,
        need_b,
        *_vocab_range(opts),
    )
    return dh if need_h else None, dw if need_w else None, db if need_b else None


BUFFER_TILE = 1024  # BLOCK_V of csrc/logprob.h: each row ends with one reference per vocab tile


def bytes_per_row(hidden: torch.Tensor, V: int) -> int:
    """Bytes per row of the single pass's buffer: V fp32 entries and one per vocab tile."""
    if _wide(hidden):
        return chunked.bytes_per_row(hidden, V)
    return 4 * (V + -(-V // BUFFER_TILE))


def logits_buffer(rows: int, V: int, hidden: torch.Tensor) -> torch.Tensor:
    """The single pass's buffer for `rows` rows (uninitialised)."""
    if _wide(hidden):
        return chunked.logits_buffer(rows, V, hidden)
    return torch.empty(rows, bytes_per_row(hidden, V) // 4, dtype=torch.float32)


def logits_fwd(hidden, weight, targets, bias, opts: LogProbOptions, return_entropy: bool, logits):
    """One chunk of the single pass: (logp [M], lse [M], entropy [M] | None) of hidden [M, H],
    leaving the chunk's exponentiated logits in `logits` (`logits_buffer`) for `logits_bwd`."""
    if _wide(hidden, weight):
        return chunked.logits_fwd(hidden, weight, targets, bias, opts, return_entropy, logits)
    logp, lse, entropy = torch.ops.fgrpo.logits_fwd(
        hidden, weight, targets, bias, opts.temperature, opts.ignore_index, return_entropy, logits
    )
    return logp, lse, entropy if return_entropy else None


def logits_bwd(logits, hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy,
               opts: LogProbOptions, dh, dw, db, accumulate: bool, fold=None):  # fmt: skip
    """`logits` → dlogits in place; dh [M, H] = dz W, dw [V, H] (+)= dz^T h, db [V] (+)= Σ dz
    (fp32; None: not wanted); `fold` (dw_src, db_src, alpha): dw, db also take alpha times
    these, in the same vocab sweeps (`backends.fold_into`)."""
    if _wide(hidden, weight):
        return chunked.logits_bwd(
            logits, hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy, opts,
            dh, dw, db, accumulate, fold,
        )  # fmt: skip
    fold_w, fold_b, alpha = (None, None, 1.0) if fold is None else fold
    torch.ops.fgrpo.logits_bwd(
        logits, hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy,
        opts.temperature, opts.ignore_index, dh, dw, db, accumulate,
        None if dw is None else fold_w, None if db is None else fold_b, float(alpha),
    )  # fmt: skip
