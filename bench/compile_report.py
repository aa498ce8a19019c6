"""Ahead-of-time compile of every kernel configuration; registers, spills, smem.

    python bench/compile_report.py [--arch 90|80|all] [--quick] [--csv PATH]

Compiles every autotune candidate of `fgrpo_kernels.backends.triton.configs.CANDIDATES` for
its dtype variants (with and without bias, entropy on and off), the single pass's row kernels
(`kernels.logits_rows`, `configs.ROW_CONFIG`) for fp32, bf16 and fp16 with and without bias
and entropy, plus the other `configs.ROW_CANDIDATES` (bench/gpu_perf.py's row-kernel variants)
for bf16 without bias, with and without entropy, and every loss-epilogue configuration of
`fgrpo_kernels.backends.triton.epilogue.AOT_SPECS`,
with `triton.compile(ASTSource(...), target=GPUTarget(...))`, then runs `ptxas -v`
(ptxas-blackwell, -arch=sm_90a / sm_80) on the PTX. Needs no GPU, but real JITFunctions:
TRITON_INTERPRET is forced to 0 before the kernels are imported. --quick: every candidate of
the bf16 key with bias and entropy (the variant with the most live registers), every row
kernel variant (seconds), one configuration per epilogue kernel. Exit 1 if a row has no
register count or a log-prob or row kernel spills on sm_90a.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
import triton.backends.nvidia  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fgrpo_kernels.backends.triton import configs  # noqa: E402
from fgrpo_kernels.backends.triton.epilogue import AOT_SPECS  # noqa: E402
from fgrpo_kernels.backends.triton.logits_rows import (  # noqa: E402
    _logits_grad_kernel,
    _logits_stats_kernel,
)
from fgrpo_kernels.backends.triton.logprob_bwd import _logprob_bwd_kernel  # noqa: E402
from fgrpo_kernels.backends.triton.logprob_fwd import _logprob_fwd_kernel  # noqa: E402

BIN = Path(triton.backends.nvidia.__file__).parent / "bin"
ARCHS = {"90": ("sm_90a", 90), "80": ("sm_80", 80)}
# the dtype variants of each precision key: (name, hidden, weight, dot precision)
VARIANTS = {
    "lowp": ("bf16", "bf16", "bf16", "ieee"),
    "lowp_fp32w": ("bf16+fp32w", "bf16", "fp32", "ieee"),
    "tf32": ("fp32-tf32", "fp32", "fp32", "tf32"),
    "fp32": ("fp32", "fp32", "fp32", "ieee"),
}
# arguments the runtime usually specialises as multiples of 16 (fresh allocations, H = 4096)
DIVISIBLE = ("h_ptr", "w_ptr", "b_ptr", "y_ptr", "H", "stride_hn", "stride_wv")


@dataclass
class Case:
    kernel: str
    key: str
    cfg: configs.KernelConfig
    dtype: str
    hdt: str
    wdt: str
    precision: str
    bias: bool
    entropy: bool


def cases(quick: bool) -> list[Case]:
    out = []
    for (kernel, key), cands in configs.CANDIDATES.items():
        name, hdt, wdt, prec = VARIANTS[key]
        for cfg in cands:
            for bias in (True, False):
                for entropy in (True, False):
                    if quick and not (key == "lowp" and bias and entropy):
                        continue
                    out.append(Case(kernel, key, cfg, name, hdt, wdt, prec, bias, entropy))
    return out


def signature(case: Case, cfg: configs.KernelConfig):
    """(kernel, signature, constexprs) of one case, argument types as the launchers pass them."""
    h, w = f"*{case.hdt}", f"*{case.wdt}"
    sig = {"h_ptr": h, "w_ptr": w, "b_ptr": w if case.bias else "constexpr", "y_ptr": "*i64"}
    const = {} if case.bias else {"b_ptr": None}
    if case.kernel == "fwd":
        fn = _logprob_fwd_kernel
        sig |= {p: "*fp32" for p in ("m_ptr", "s_ptr", "zy_ptr", "t_ptr")}
        ints = ("N", "V", "H", "stride_hn", "stride_wv")
        sig |= dict.fromkeys(ints, "i32") | {"inv_t": "fp32"}
        sig |= {"n_splits": "i32", "tiles_per_split": "i32"}
        flags = {"HAS_BIAS": case.bias, "HAS_ENTROPY": case.entropy}
    else:
        fn = _logprob_bwd_kernel
        ent = "*fp32" if case.entropy else "constexpr"
        sig |= {"lse_ptr": "*fp32", "ent_ptr": ent, "g_ptr": "*fp32", "g_ent_ptr": ent}
        sig["scale_ptr"] = "*fp32"
        const |= {} if case.entropy else {"ent_ptr": None, "g_ent_ptr": None}
        sig["dz_ptr"] = h
        ints = ("N", "V", "H", "stride_hn", "stride_wv", "stride_dz", "v_begin", "v_end")
        sig |= dict.fromkeys(ints, "i32") | {"n_vtiles": "i32", "inv_t": "fp32"}
        sig["ignore_index"] = "i32"
        flags = {"HAS_BIAS": case.bias, "HAS_GRAD_ENTROPY": case.entropy}
    const |= flags | {"BLOCK_N": cfg.block_n, "BLOCK_V": cfg.block_v, "BLOCK_K": cfg.block_k}
    const |= {"UPCAST_DOT": False, "DOT_PRECISION": case.precision}
    for name in const:
        sig[name] = "constexpr"
    assert list(sig) == fn.arg_names, (list(sig), fn.arg_names)
    return fn, sig, const


def ptxas_stats(ptx: str, arch: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for tool in ("ptxas-blackwell", "ptxas"):
            cmd = [str(BIN / tool), f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.o")]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode == 0:
                break
        else:
            raise RuntimeError(f"ptxas failed for {arch}: {res.stderr[-2000:]}")
    log = res.stderr + res.stdout
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "ptxas": tool,
        "regs": int(regs.group(1)) if regs else -1,
        "spill_st": int(spills.group(1)) if spills else -1,
        "spill_ld": int(spills.group(2)) if spills else -1,
    }


def compile_case(case: Case, arch_key: str) -> dict:
    arch, cc = ARCHS[arch_key]
    cfg = case.cfg
    fn, sig, const = signature(case, cfg)
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in DIVISIBLE}
    if not case.bias:
        attrs.pop((fn.arg_names.index("b_ptr"),))
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    row = {
        "kernel": fn.__name__,
        "arch": arch,
        "dtype": case.dtype,
        "bias": int(case.bias),
        "entropy": int(case.entropy),
        "tile": f"{cfg.block_n}x{cfg.block_v}x{cfg.block_k}",
        "warps": cfg.num_warps,
        "stages": cfg.num_stages,
    }
    row |= ptxas_stats(compiled.asm["ptx"], arch)
    row["smem"] = compiled.metadata.shared
    return row


def epilogue_rows(arch_key: str, quick: bool) -> list[dict]:
    """The loss-epilogue kernels, one row per `kernels.epilogue.AOT_SPECS` entry (quick: one per
    kernel function)."""
    arch, cc = ARCHS[arch_key]
    rows, seen = [], set()
    for spec in AOT_SPECS:
        fn = spec["fn"]
        if quick and fn.__name__ in seen:
            continue
        seen.add(fn.__name__)
        src = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"])
        compiled = triton.compile(
            src, target=GPUTarget("cuda", cc, 32), options={"num_warps": spec["num_warps"]}
        )
        c = spec["constexprs"]
        row = {
            "kernel": fn.__name__,
            "arch": arch,
            "dtype": spec["name"],
            "bias": "-",
            "entropy": "-",
            "tile": f"G{c['BLOCK_G']}xT{c['BLOCK_T']}",
            "warps": spec["num_warps"],
            "stages": compiled.metadata.num_stages,
        }
        row |= ptxas_stats(compiled.asm["ptx"], arch)
        row["smem"] = compiled.metadata.shared
        rows.append(row)
    return rows


ROW_DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}  # name -> bias and dlogits dtype


def row_kernel_signature(fn, dtype: str, bias: bool, entropy: bool, cfg=configs.ROW_CONFIG):
    """(signature, constexprs) of a single-pass row kernel as `logits_rows` launches it: the
    buffer fp32, bias and the dlogits in the operand dtype (fp32: the buffer itself)."""
    sig, const = {}, {"BLOCK_N": cfg.block_n, "BLOCK_V": cfg.block_v}
    flag = "HAS_ENTROPY" if fn is _logits_stats_kernel else "HAS_GRAD_ENTROPY"
    const |= {"HAS_BIAS": bias, flag: entropy}
    for arg in fn.arg_names:
        if arg in const:
            sig[arg] = "constexpr"
        elif arg == "b_ptr":
            sig[arg] = f"*{dtype}" if bias else "constexpr"
            const |= {} if bias else {"b_ptr": None}
        elif arg in ("ent_ptr", "g_ent_ptr") and not entropy:
            sig[arg], const[arg] = "constexpr", None
        elif arg == "y_ptr":
            sig[arg] = "*i64"
        elif arg == "dz_ptr":
            sig[arg] = f"*{dtype}"
        elif arg.endswith("_ptr"):
            sig[arg] = "*fp32"
        else:
            sig[arg] = "fp32" if arg == "inv_t" else "i32"
    return sig, const


def row_kernel_rows(arch_key: str) -> list[dict]:
    """The single pass's row kernels at ROW_CONFIG for each operand dtype, bias and entropy;
    the other `configs.ROW_CANDIDATES` (bench/gpu_perf.py's variants) for bf16 without bias."""
    arch, cc = ARCHS[arch_key]
    variants = [(name, dtype, bias, entropy, configs.ROW_CONFIG)
                for name, dtype in ROW_DTYPES.items() for bias in (True, False)
                for entropy in (True, False)]  # fmt: skip
    variants += [("bf16", "bf16", False, entropy, cfg) for cfg in configs.ROW_CANDIDATES
                 if cfg != configs.ROW_CONFIG for entropy in (True, False)]  # fmt: skip
    rows = []
    for fn in (_logits_stats_kernel, _logits_grad_kernel):
        for name, dtype, bias, entropy, cfg in variants:
            sig, const = row_kernel_signature(fn, dtype, bias, entropy, cfg)
            src = ASTSource(fn=fn, signature=sig, constexprs=const)
            options = {"num_warps": cfg.num_warps}
            compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
            row = {
                "kernel": fn.__name__, "arch": arch, "dtype": name, "bias": int(bias),
                "entropy": int(entropy), "tile": f"{cfg.block_n}x{cfg.block_v}",
                "warps": cfg.num_warps, "stages": compiled.metadata.num_stages,
            }  # fmt: skip
            row |= ptxas_stats(compiled.asm["ptx"], arch)
            row["smem"] = compiled.metadata.shared
            rows.append(row)
    return rows


def spills_on_hopper(row: dict) -> bool:
    """A log-prob or row kernel that spills on sm_90a (the epilogues' few bytes are tolerated)."""
    heavy = "logprob" in row["kernel"] or "logits" in row["kernel"]
    return heavy and row["arch"] == "sm_90a" and row["spill_st"] != 0


COLUMNS = ("kernel", "arch", "dtype", "bias", "entropy", "tile", "warps", "stages", "regs",
           "spill_st", "spill_ld", "smem", "ptxas")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("90", "80", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="one configuration per kernel")
    ap.add_argument("--csv", type=Path, help="also write the table as CSV")
    args = ap.parse_args(argv)
    if not isinstance(_logprob_fwd_kernel, JITFunction):
        print("compile_report: kernels are interpreted; unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    archs = ("90", "80") if args.arch == "all" else (args.arch,)
    rows = [compile_case(c, a) for a in archs for c in cases(args.quick)]
    rows += [r for a in archs for r in row_kernel_rows(a)]
    rows += [r for a in archs for r in epilogue_rows(a, args.quick)]
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in COLUMNS) + " |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=COLUMNS)
            wr.writeheader()
            wr.writerows(rows)
    bad = [r for r in rows if r["regs"] <= 0 or spills_on_hopper(r)]
    for r in bad:
        print(f"compile_report: {r['kernel']} {r['dtype']} {r['tile']}: regs {r['regs']}, "
              f"spills {r['spill_st']} B", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
