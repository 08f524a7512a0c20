#!/bin/bash
# Builds stand-in ROCm libraries (every function returns an error) so that the jax ROCm plugin
# loads on a machine without ROCm and can compile deviceless for an AMD target (gfx942).
# Usage: build.sh OUT_DIR ; then, in a venv with jax[rocm7-local]:
#   LD_LIBRARY_PATH=OUT_DIR python experiments/benchmarks/aot_report.py --target mi300x
set -eu
here=$(cd "$(dirname "$0")" && pwd); out=${1:?output directory}; mkdir -p "$out"
cc -shared -fPIC -o "$out/libamdhip64.so.7" "$here/hip.c" -Wl,--version-script="$here/hip.map"
cc -shared -fPIC -o "$out/libMIOpen.so.1" "$here/miopen.c" -Wl,--version-script="$here/miopen.map"
cc -shared -fPIC -o "$out/librocblas.so.5" "$here/rest.c"
for lib in libhipblaslt.so.1 libhipfft.so.0 librccl.so.1 librocm_smi64.so.1 librocprofiler-sdk.so.1; do
  cc -shared -fPIC -o "$out/$lib" "$here/empty.c"
done
echo "stand-in ROCm libraries in $out"
