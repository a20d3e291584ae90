#!/usr/bin/env bash
# The CPU side of scripts/gpu/check.sh: builds what travels to the GPU machine into CARRY
# (default gpu-carry/, ignored by git) and checks that it fits the 64 MiB a device call
# carries: the release CLI with --features cuda, stripped, and the abi3 wheel with
# --features cuda (maturin, from a venv under target/). The repository's tracked files
# (and untracked, not ignored ones) travel too; their size counts against the same limit.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=${CARRY:-gpu-carry}
LIMIT_MIB=64
rm -rf "$CARRY"
mkdir -p "$CARRY"
cargo build --release -p flashloss-cli --features cuda
strip -o "$CARRY/flashloss" target/release/flashloss
VENV=target/maturin-venv
[ -x "$VENV/bin/maturin" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "maturin>=1.9.4,<2"; }
(cd crates/flashloss-py && CARGO_TARGET_DIR="$PWD/../../target" "../../$VENV/bin/maturin" build \
  --release --features cuda --strip --out "../../$CARRY")
ls -l "$CARRY"
carry=$(du -sb "$CARRY" | cut -f1)
tracked=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- | tail -n 1 | cut -f1)
total=$((carry + tracked))
echo "carry $carry B + working tree $tracked B = $total B (limit $((LIMIT_MIB << 20)) B)"
[ "$total" -le $((LIMIT_MIB << 20)) ] || { echo "over the $LIMIT_MIB MiB a device call carries"; exit 1; }
