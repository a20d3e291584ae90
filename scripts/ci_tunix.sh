#!/usr/bin/env bash
# CI stage for flashloss.tunix (issue 34): a Python >= 3.11 venv with the package and its
# `tunix` extra (google-tunix 0.1.7, jax[cpu] 0.10.x), then the equality tests against
# Tunix and the short GRPOLearner run (crates/flashloss-py/tests/test_tunix.py).
# Kept apart from target/py-venv so that Tunix's dependencies cannot move its jax.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), f"Tunix needs Python >= 3.11, got {sys.version}"'
VENV=${TUNIX_VENV:-target/tunix-venv}
"$PY" -m venv "$VENV"
# The extra pulls only what flashloss.tunix imports; the tests and the A/B's plot also need
# pytest and matplotlib.
CARGO_TARGET_DIR="$PWD/target" "$VENV/bin/pip" install -q "./crates/flashloss-py[tunix]" pytest matplotlib
# Run from outside the source tree so that the installed package (with its native module) is tested.
PYBIN="$(cd "$VENV" && pwd)/bin/python"
(cd crates/flashloss-py/tests && "$PYBIN" -m pytest -q -p no:cacheprovider test_tunix.py)
