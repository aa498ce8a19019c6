"""Every shipped epilogue kernel configuration compiles for sm_90 (no GPU needed).

The interpreter (TRITON_INTERPRET=1, set by conftest) accepts code the compiler rejects, and the
interpret decision is taken when `@triton.jit` decorates, so the compile runs in a subprocess
with TRITON_INTERPRET=0 over `fgrpo_kernels.backends.triton.epilogue.AOT_SPECS`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMPILE_ALL = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from fgrpo_kernels.backends.triton.epilogue import AOT_SPECS

results = {}
for spec in AOT_SPECS:
    src = triton.compiler.ASTSource(
        fn=spec["fn"], signature=spec["signature"], constexprs=spec["constexprs"]
    )
    try:
        kernel = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": spec["num_warps"]}
        )
        entry = ".entry " + spec["fn"].__name__
        results[spec["name"]] = "ok" if entry in kernel.asm["ptx"] else "no entry in the PTX"
    except Exception as exc:  # report every failing configuration, not just the first
        results[spec["name"]] = f"{type(exc).__name__}: {str(exc)[:2000]}"
print(json.dumps(results))
"""


def _twin_name(value):
    """JSON for the divergence twins (jit functions, interpreted here); anything else is not
    plain."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(value, (JITFunction, InterpretedFunction)):
        return value.fn.__name__
    raise TypeError(f"not a plain constexpr: {value!r}")


def test_every_aot_spec_compiles_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_ALL], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) >= 3, results
    failed = {name: why for name, why in results.items() if why != "ok"}
    assert not failed, "\n".join(f"{name}: {why}" for name, why in failed.items())


def test_aot_specs_cover_every_kernel_and_divergence():
    from fgrpo_kernels.backends.triton import epilogue
    from fgrpo_kernels.divergences import TABLE

    names = {spec["name"] for spec in epilogue.AOT_SPECS}
    for spec in TABLE.values():
        assert {f"fgrpo_{spec.name}_token", f"fgrpo_{spec.name}_sequence"} <= names
    kernels = {spec["fn"].__name__ for spec in epilogue.AOT_SPECS}
    assert kernels == {
        "_fgrpo_epilogue_kernel",
        "_grpo_epilogue_kernel",
        "_gift_epilogue_kernel",
    }
    for spec in epilogue.AOT_SPECS:
        args = spec["fn"].arg_names
        assert list(spec["signature"]) == list(args), spec["name"]
        for arg, kind in spec["signature"].items():
            assert (kind == "constexpr") == (arg in spec["constexprs"]), (spec["name"], arg)
        json.dumps(spec["constexprs"], default=_twin_name)  # plain values (or divergence twins)
