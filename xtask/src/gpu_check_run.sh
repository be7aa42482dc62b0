#!/usr/bin/env bash
# Runs the CUDA tests and benchmarks built by `cargo xtask gpu-check` on a GPU machine,
# in one command, and prints a summary. Usage (from the repository root): bash gpu-check/run.sh
# Environment: GPU_CHECK_LIMIT, seconds each step may run (default 300);
# GPU_CHECK_SANITIZE=1 also runs the CUDA tests under compute-sanitizer (memcheck) at the end;
# GPU_CHECK_PROFILE=preset:rank:path (e.g. bert-base:1:device) times every kernel of that
# cuda_hooks row with ncu (7 steps: 5 warm-up, 2 timed); GPU_CHECK_REPORT=0 skips the CPU report.
set -u
limit=${GPU_CHECK_LIMIT:-300}
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

# 2. Does a binary built on the developer machine start here at all? If not, the Rust
#    parts are reported as failed and the PyTorch reference still runs.
status=0
starts=1
if ! "$here/lowrank-primitives-test" --list >/dev/null 2>>"$log"; then
  say "FAIL: the test binaries do not start on this machine (see $log)"
  starts=0
  status=1
else
  say "binary starts: ok"
fi

# Runs a command with a time limit, its output to the log and to a file; sets rc.
run_logged() {
  local limit=$1 file=$2
  shift 2
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log" "$file"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && say "TIMEOUT after ${limit}s: $*"
}

# 3. The CUDA tests (every primitive against the CPU result), then the benchmarks.
tests_rc=1 hooks_rc=1 nccl_rc=1 bench_rc=1 cuda_hooks_rc=1 report_rc=1 pipe_rc=1 pipe_bench_rc=1
for f in tests hooks nccl bench cuda_hooks pytorch pipe pipe_bench; do : >"$out/$f.log"; done
rm -f "$out/cuda_hooks.jsonl" "$out/pytorch_hooks.jsonl" "$out/report.jsonl" "$out/report.err"
if [ "$starts" -eq 1 ]; then
  run_logged "$limit" "$out/tests.log" "$here/lowrank-primitives-test" cuda --nocapture --test-threads 1
  tests_rc=$rc
  run_logged "$limit" "$out/hooks.log" "$here/ddp-hooks-cuda-test" --nocapture --test-threads 1
  hooks_rc=$rc
  run_logged "$limit" "$out/nccl.log" "$here/collectives-nccl-test" --nocapture --test-threads 1
  nccl_rc=$rc
  run_logged "$limit" "$out/nccl.log" "$here/collectives-threads-cuda-test" --nocapture
  [ "$rc" -eq 0 ] || nccl_rc=1
  run_logged "$limit" "$out/bench.log" "$here/lowrank-cuda-bench"
  bench_rc=$rc
  # Partitions on the GPU (pipe::cuda): the device suite (layers against the CPU, two
  # streams bit for bit against one, memory by checkpoint mode, the race and poison
  # tests), then the step and overhead bench.
  run_logged "$limit" "$out/pipe.log" "$here/pipe-cuda-test" --show-output --test-threads 1
  pipe_rc=$rc
  run_logged "$limit" "$out/pipe_bench.log" "$here/pipe-cuda-bench"
  pipe_bench_rc=$rc
  run_logged "$limit" "$out/pipe.log" "$here/pipe-cuda-example"
  [ "$rc" -eq 0 ] || pipe_rc=1
  # 4. PowerSGD through the reducer on NCCL: device path, staged path, HBM bound
  #    (writes $out/cuda_hooks.jsonl).
  OUT=$out run_logged "$limit" "$out/cuda_hooks.log" "$here/ddp-hooks-cuda-hooks-bench"
  cuda_hooks_rc=$rc
fi
for r in "$tests_rc" "$hooks_rc" "$nccl_rc" "$bench_rc" "$cuda_hooks_rc" "$pipe_rc" "$pipe_bench_rc"; do
  [ "$r" -eq 0 ] || status=1
done

# 5. PyTorch's powerSGD_hook on the same shapes (writes $out/pytorch_hooks.jsonl). The
#    first Python that imports torch runs it; it never fails the check.
torch_py=
for py in python3 /opt/torch/.venv/bin/python3; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import torch' >/dev/null 2>&1; then
    torch_py=$py
    break
  fi
done
if [ -n "$torch_py" ]; then
  say "pytorch: $torch_py"
  OUT=$out run_logged "$limit" "$out/pytorch.log" "$torch_py" "$here/torch_hooks.py"
  torch_rc=$rc
else
  say "pytorch: skipped (no Python that imports torch: tried python3, /opt/torch/.venv/bin/python3)"
  torch_rc=1
fi

# 6. The CPU compression report, quick (JSON lines in $out/report.jsonl).
report_rc=0
if [ "$starts" -eq 1 ] && [ "${GPU_CHECK_REPORT:-1}" != 0 ]; then
  timeout -k 10 "$limit" "$here/ddp-hooks-report-bench" --quick >"$out/report.jsonl" 2>"$out/report.err"
  report_rc=$?
  [ "$report_rc" -eq 124 ] && say "TIMEOUT after ${limit}s: the report"
  [ "$report_rc" -eq 0 ] || status=1
fi

# 7. The comparison (any Python 3; the files are JSON lines).
summary_py=${torch_py:-python3}
if command -v "$summary_py" >/dev/null 2>&1; then
  "$summary_py" - "$out" <<'PY' 2>&1 | tee -a "$log"
import json, os, sys

out = sys.argv[1]

def rows(name):
    try:
        with open(os.path.join(out, name)) as f:
            return [json.loads(l) for l in f if l.startswith("{")]
    except (OSError, ValueError) as e:
        print(f"summary: {name}: {e}")
        return []

ours = {(r["preset"], r["rank"], r["path"]): r for r in rows("cuda_hooks.jsonl")}
theirs = {(r["preset"], r["rank"], r["path"]): r for r in rows("pytorch_hooks.jsonl")}
keys = sorted({(p, r) for p, r, _ in list(ours) + list(theirs)}, key=lambda k: (k[0], k[1]))
order = ["linear4x1024", "bert-base", "gpt2-small"]
keys.sort(key=lambda k: (order.index(k[0]) if k[0] in order else 9, k[1]))

def ms(d, k):
    r = d.get(k)
    return None if r is None else r["hook_ms"]

def show(v, fmt="{:.3f}"):
    return "-" if v is None else fmt.format(v)

print()
print("PowerSGD hook time per step (ms; step minus the noop hook's), NCCL world size 1")
print(f"{'preset':<14} {'r':>2} {'device':>8} {'staged':>8} {'byshape':>8} {'unbatch':>8} {'pytorch':>8} "
      f"{'pt-batch':>8} {'dev/pt':>7} {'bound':>7} {'x bound':>7}")
faster, within = [], []
for preset, rank in keys:
    dev = ms(ours, (preset, rank, "device"))
    stg = ms(ours, (preset, rank, "staged"))
    bys = ms(ours, (preset, rank, "device-by-shape"))
    unb = ms(ours, (preset, rank, "device-unbatched"))
    pt = ms(theirs, (preset, rank, "pytorch"))
    ptb = ms(theirs, (preset, rank, "pytorch-batched"))
    best = min([v for v in (pt, ptb) if v is not None], default=None)
    ratio = dev / best if dev is not None and best and best > 0 else None
    row = ours.get((preset, rank, "device"))
    bound = row["bound_ms"] if row else None
    xb = row["bound_ratio"] if row else None
    print(f"{preset:<14} {rank:>2} {show(dev):>8} {show(stg):>8} {show(bys):>8} {show(unb):>8} {show(pt):>8} "
          f"{show(ptb):>8} {show(ratio, '{:.2f}'):>7} {show(bound):>7} {show(xb, '{:.2f}'):>7}")
    faster.append(None if dev is None or best is None else dev < best)
    if preset in ("bert-base", "gpt2-small"):
        within.append(None if xb is None else xb <= 2.0)

def verdict(results):
    if not results or any(v is None for v in results):
        return "NOT MEASURED" if not any(v is not None for v in results) else "INCOMPLETE"
    return "met" if all(results) else "NOT met"

print("dev/pt: device path over the faster of PyTorch's two (pytorch, pt-batch); "
      "x bound: device path over 28 B per compressed element at the copy bandwidth")
print(f"goal: device path faster than PyTorch's hook on every preset and rank: {verdict(faster)} "
      f"({sum(1 for v in faster if v)}/{len(faster)})")
print(f"goal: device path <= 2x the HBM bound on bert-base and gpt2-small: {verdict(within)} "
      f"({sum(1 for v in within if v)}/{len(within)})")

report = rows("report.jsonl")
machine = next((r for r in report if r.get("kind") == "machine"), None)
measured = [r for r in report if r.get("kind") == "row"]
print()
if machine:
    print(f"CPU report (--quick): {machine.get('cpu')} | {machine.get('cores')} cores | "
          f"{machine.get('isa')} | read {machine.get('read_gbps')} GB/s (1 thread)")
for r in measured:
    label = r["hook"] + (f" r{r['rank']}" if r.get("rank") else "")
    xb = r.get("bound_ratio")
    print(f"  {r['model']:<14} {label:<22} {r['hook_ms']:>9.3f} ms"
          + ("" if xb is None else f"  {xb:.2f}x bound"))
PY
else
  say "summary: no python3 to compare the JSON lines; see $out/*.jsonl"
fi

ok_word() { if [ "$1" -eq 0 ]; then echo clean; else echo "FAILED (rc $1)"; fi; }
# 8. Optional: the CUDA tests again under compute-sanitizer's memcheck (device memory
#    errors in our kernels and cuBLAS calls; leaks of device allocations at exit).
san_note=
if [ "${GPU_CHECK_SANITIZE:-0}" = 1 ] && [ "$starts" -eq 1 ]; then
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)
  if [ -z "$san" ]; then
    san_note="; sanitizer not found"
  else
    : >"$out/sanitize.log"
    san_rc=0
    for t in "lowrank-primitives-test cuda" "ddp-hooks-cuda-test" "pipe-cuda-test"; do
      set -- $t
      # NCCL probes its kernels with cudaFuncGetAttributes and gets "no kernel image" for
      # architectures it was not built for: API errors it handles itself, not ours (our
      # own calls' errors are Results the tests check), so those are not reported.
      run_logged "$limit" "$out/sanitize.log" "$san" --tool memcheck --leak-check full --report-api-errors no --error-exitcode 42 "$here/$1" ${2:-} --test-threads 1
      [ "$rc" -eq 0 ] || san_rc=$rc
    done
    san_note="; compute-sanitizer memcheck $(ok_word "$san_rc") ($(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitize.log") clean summaries)"
    [ "$san_rc" -eq 0 ] || status=1
  fi
fi

# 9. Optional: the device time of every kernel of one cuda_hooks row, by ncu (one metric,
#    no clock control), summed by kernel name.
if [ -n "${GPU_CHECK_PROFILE:-}" ] && [ "$starts" -eq 1 ]; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -z "$ncu" ]; then
    say "profile: ncu not found"
  else
    CUDA_HOOKS_ONLY=$GPU_CHECK_PROFILE CUDA_HOOKS_STEPS=2 timeout -k 10 "$limit" "$ncu" --clock-control none --csv \
      --metrics gpu__time_duration.sum "$here/ddp-hooks-cuda-hooks-bench" >"$out/ncu.csv" 2>"$out/ncu.err"
    say "profile ($GPU_CHECK_PROFILE, ncu rc $?): device time by kernel over the noop and PowerSGD runs (7 steps each)"
    "${torch_py:-python3}" - "$out/ncu.csv" <<'PY' 2>&1 | tee -a "$log"
import csv, sys, collections
rows = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                 "msecond": 1e3, "s": 1e6, "second": 1e6}[unit]
        rows.append((r["Kernel Name"][:60], v * scale))
tot = collections.defaultdict(lambda: [0, 0.0])
for name, us in rows:
    tot[name][0] += 1
    tot[name][1] += us
print(f"{'kernel':<60} {'launches':>8} {'total us':>10} {'us/launch':>9}")
for name, (n, us) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:25]:
    print(f"{name:<60} {n:>8} {us:>10.1f} {us / n:>9.2f}")
print(f"all kernels: {len(rows)} launches, {sum(u for _, u in rows):.1f} us")
PY
  fi
fi

ok() { if [ "$1" -eq 0 ]; then echo "$2"; else echo "$3"; fi; }
count() { local n; n=$(grep -c "$1" "$2" 2>/dev/null); echo "${n:-0}"; }
# pipe::cuda, a line per check: each test's result, then the bench's figure lines.
grep -E '^test .* \.\.\. (ok|FAILED)$' "$out/pipe.log" | sed 's/^test /pipe-cuda test: /' | tee -a "$log"
grep -E '^(  (always|except_last|never) )' "$out/pipe.log" | sed 's/^  /pipe-cuda memory: /' | tee -a "$log"
grep '^pipe-cuda:' "$out/pipe_bench.log" | tee -a "$log"
grep 'partitions on 2 streams against 1 partition' "$out/pipe.log" | sed 's/^/pipe-cuda example: /' | tee -a "$log"
say "summary: pipe CUDA tests $(ok "$pipe_rc" passed FAILED) ($(grep -c ' ok$' "$out/pipe.log") ok, $(grep -c '^skipped' "$out/pipe.log") skipped); pipe CUDA bench $(ok "$pipe_bench_rc" ran FAILED)$(grep -q '^skipped' "$out/pipe_bench.log" && echo ' (skipped)')"
say "summary: lowrank tests $(ok "$tests_rc" passed FAILED) ($(grep -c ': ok$' "$out/tests.log") CUDA checks ok, $(grep -c 'skipped' "$out/tests.log") skipped); ddp-hooks CUDA test $(ok "$hooks_rc" passed FAILED) ($(grep -c 'skipped' "$out/hooks.log") skipped); NCCL tests $(ok "$nccl_rc" passed FAILED) ($(grep -c 'skipped' "$out/nccl.log") skipped); lowrank bench $(ok "$bench_rc" ran FAILED); cuda_hooks bench $(ok "$cuda_hooks_rc" ran FAILED)$(grep -q '^skipped' "$out/cuda_hooks.log" && echo ' (skipped)'); pytorch reference $(ok "$torch_rc" ran 'did not run')$(grep -q '^pytorch: skipped' "$out/pytorch.log" && echo ' (skipped)'); CPU report $(ok "$report_rc" ran FAILED) ($(count '"kind":"row"' "$out/report.jsonl") rows)$san_note"
exit $status
