# shellcheck shell=bash
# Sourced by verify.sh and check.sh on the GPU machine (no Rust; CUDA libraries from the
# Python packages' wheels). Needs OUT set. Points LD_LIBRARY_PATH at every nvidia/*/lib
# folder of the site-packages (cuBLAS, NVRTC, NCCL), links libnccl.so to the wheel's
# libnccl.so.2 (cudarc looks for libnccl.so) and records nvidia-smi in $OUT/device.txt.
SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
LIBS=$(ls -d "$SITE"/nvidia/*/lib 2>/dev/null | tr '\n' ':')
mkdir -p "$OUT/lib"
NCCL2=$(ls "$SITE"/nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -n 1)
[ -n "$NCCL2" ] && ln -sf "$NCCL2" "$OUT/lib/libnccl.so"
export LD_LIBRARY_PATH="$OUT/lib:$LIBS${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/device.txt" 2>&1
