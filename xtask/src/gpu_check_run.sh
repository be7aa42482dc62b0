#!/usr/bin/env bash
# Runs the CUDA tests and benchmarks built by `cargo xtask gpu-check` on a GPU machine,
# in one command, and prints a summary. Usage (from the repository root): bash gpu-check/run.sh
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
log=$out/gpu-check.log
: >"$log"
say() { echo "$@" | tee -a "$log"; }

# 1. The libraries: the driver from the system, cuBLAS / NVRTC / NCCL from the CUDA
#    Python packages (nvidia-cublas, nvidia-cuda-nvrtc, nvidia-nccl-cu13) if not on
#    the system. cudarc loads libcublas.so.13 and libnvrtc.so.13 by name, but looks for
#    NCCL as libnccl.so, which the pip wheel ships only as libnccl.so.2: link it.
libdirs=()
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64; do
  [ -d "$d" ] && libdirs+=("$d")
done
for py in python3 /opt/torch/.venv/bin/python3; do
  command -v "$py" >/dev/null 2>&1 || continue
  while IFS= read -r d; do libdirs+=("$d"); done < <("$py" - <<'PY' 2>/dev/null
import glob, os, site
roots = set(site.getsitepackages() + [site.getusersitepackages()])
for root in roots:
    for lib in glob.glob(os.path.join(root, "nvidia", "**", "lib*.so*"), recursive=True):
        print(os.path.dirname(lib))
PY
  )
done
links=$(mktemp -d)
for d in "${libdirs[@]}"; do
  if [ -e "$d/libnccl.so.2" ] && [ ! -e "$links/libnccl.so" ]; then ln -s "$d/libnccl.so.2" "$links/libnccl.so"; fi
done
LD_LIBRARY_PATH=$links:$(printf '%s\n' "${libdirs[@]}" | awk '!seen[$0]++' | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
for lib in libcuda.so.1 libcublas.so.13 libnvrtc.so.13 libnccl.so; do
  found=$(for d in ${LD_LIBRARY_PATH//:/ }; do [ -e "$d/$lib" ] && echo "$d/$lib" && break; done)
  say "library $lib: ${found:-NOT FOUND}"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$log"

# 2. Does a binary built on the developer machine start here at all?
if ! "$here/lowrank-primitives-test" --list >/dev/null 2>>"$log"; then
  say "FAIL: the test binary does not start on this machine (see $log)"
  exit 1
fi
say "binary starts: ok"

# 3. The CUDA tests (every primitive against the CPU result), then the benchmark.
status=0
"$here/lowrank-primitives-test" cuda --nocapture --test-threads 1 2>&1 | tee -a "$log" "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" -eq 0 ] || status=1
"$here/ddp-hooks-cuda-test" --nocapture --test-threads 1 2>&1 | tee -a "$log" "$out/hooks.log"
hooks_rc=${PIPESTATUS[0]}
[ "$hooks_rc" -eq 0 ] || status=1
"$here/collectives-nccl-test" --nocapture --test-threads 1 2>&1 | tee -a "$log" "$out/nccl.log"
nccl_rc=${PIPESTATUS[0]}
"$here/collectives-threads-cuda-test" --nocapture 2>&1 | tee -a "$log" "$out/nccl.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || nccl_rc=1
[ "$nccl_rc" -eq 0 ] || status=1
"$here/lowrank-cuda-bench" 2>&1 | tee -a "$log" "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" -eq 0 ] || status=1

say "summary: lowrank tests $( [ "$tests_rc" -eq 0 ] && echo passed || echo FAILED ) ($(grep -c ': ok$' "$out/tests.log") CUDA checks ok, $(grep -c 'skipped' "$out/tests.log") skipped); ddp-hooks CUDA test $( [ "$hooks_rc" -eq 0 ] && echo passed || echo FAILED ) ($(grep -c 'skipped' "$out/hooks.log") skipped); NCCL tests $( [ "$nccl_rc" -eq 0 ] && echo passed || echo FAILED ) ($(grep -c 'skipped' "$out/nccl.log") skipped); bench $( [ "$bench_rc" -eq 0 ] && echo ran || echo FAILED )"
exit $status
