#!/usr/bin/env bash
# A second venv for the verl integration (fgrpo_kernels.integrations.verl, tests/test_verl_*.py):
# CPU torch, then verl 0.9.1 (it brings ray and pins transformers 5.10.4), then this repo.
# NB: not `pip install -e ".[dev]"`: its trl 1.16 breaks verl's apply_monkey_patch (verl
# imports AutoModelForCausalLMWithValueHead from trl whenever trl is installed, and trl 1.16 no
# longer has it), so the package goes in with --no-deps plus its own deps and the test tools.
# Usage: bash bench/verl_env.sh [VENV_DIR]   (default .venv-verl, relative to the repo root)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-verl}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q verl==0.9.1
"$py" -m pip install -q --no-deps -e .
"$py" -m pip install -q "triton>=3.2" numpy ninja "pytest>=8" "hypothesis>=6.100"
"$py" - <<'PY'
import importlib.util

import fgrpo_kernels
import transformers
import verl

assert transformers.__version__ == "5.10.4", f"transformers {transformers.__version__}: not verl's pin"
assert importlib.util.find_spec("trl") is None, "trl is installed: verl's apply_monkey_patch fails"
print("verl", verl.__version__, "transformers", transformers.__version__,
      "fgrpo_kernels", fgrpo_kernels.__version__)
PY
