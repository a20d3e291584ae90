#!/usr/bin/env bash
# CI stage for flashloss.verl: a venv with verl 0.9.1 and the few packages that importing
# its fused-kernel modules needs on CPU, then the equality tests against verl's own torch
# path (crates/flashloss-py/tests/test_verl.py).
#
# verl's declared dependencies (ray[default], wandb, datasets, peft, hydra, ...) are for
# training clusters; `import verl` and its fused-kernel modules need only torch, transformers,
# numpy, packaging, ray, tensordict and omegaconf, so verl is installed with --no-deps beside
# exactly those. Kept apart
# from target/py-venv so that verl's transformers pin cannot move the main suite's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VERL_VENV:-target/verl-venv}
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
# torch's Linux wheel from PyPI carries CUDA (about 6 GB installed): take it from the main
# suite's venv (VERL_TORCH_VENV, target/py-venv by default) when that venv has it, through a
# .pth line. That path comes after this venv's own site-packages, so verl's pinned
# transformers (installed here) shadows the main suite's, which pip leaves in place.
TORCH_VENV=${VERL_TORCH_VENV:-target/py-venv}
if "$TORCH_VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$TORCH_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
    > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torch_venv.pth"
fi
# transformers[kernels]: the `kernels` release this transformers declares. Without it, the
# main suite's newer `kernels` (seen through the .pth line) is imported by this transformers'
# hub_kernels module, and kernels 0.19's LayerRepository refuses its calls (the stop-52 CI).
"$PIP" install -q torch numpy pytest packaging "transformers[kernels]>=5.5.3,<5.11,!=5.6.0" "ray>=2.41.0" \
    "tensordict>=0.8.0,<=0.10.0,!=0.9.0" omegaconf
"$PIP" install -q --no-deps "verl==0.9.1"
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}" "$PIP" install -q --no-deps ./crates/flashloss-py
# Run from outside the source tree so that the installed package (with its native module) is tested.
PYBIN="$(cd "$VENV" && pwd)/bin/python"
(cd crates/flashloss-py/tests && "$PYBIN" -m pytest -q -p no:cacheprovider test_verl.py)
