#!/usr/bin/env python3
"""PyTorch's powerSGD_hook on the gpu-check presets: the reference for issue 17.

Shipped by `cargo xtask gpu-check` and run by `gpu-check/run.sh` on a GPU machine, next
to the `cuda_hooks` bench, which measures our hook on the same shapes the same way:

- one process, an NCCL group of world size 1 (a FileStore rendezvous), GPU 0;
- a module whose parameters have the preset's shapes, in forward order, wrapped in
  DistributedDataParallel with its default buckets (bucket_cap_mb=25, first bucket 1 MiB);
- the loss is sum((p * c).sum()) with a fixed random c per parameter, so backward gives
  every parameter the fixed gradient c for the cost of one element-wise pass;
- a step is the backward pass between two torch.cuda.synchronize() (the forward runs
  before it, untimed); the hook time is the median step with powerSGD_hook (after
  warm-up, so compression is active) minus the median step with noop_hook;
- PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=2), PyTorch's other
  defaults; path "pytorch" with batch_tensors_with_same_shape=False (PyTorch's default),
  "pytorch-batched" with True;
- the bound: 28 bytes per compressed element (PyTorch's own test: compress an n x m view
  iff (n + m) r' min_compression_rate < n m, r' = min(n, m, r)) at the device copy
  bandwidth measured here (a 1 GiB copy, read plus write).

Output: one JSON object per row (preset, rank, path, hook_ms, bound_ms, bound_ratio,
step_ms, noop_ms), also written to $OUT/pytorch_hooks.jsonl when OUT is set. Any failure
prints `pytorch: skipped (<reason>)` and exits 0: this is a reference, not a test.
"""

import json
import os
import statistics
import sys
import tempfile
import time

RANKS = (1, 2, 4)
WARMUP = 5
START_ITER = 2
STEPS = 20
MIN_COMPRESSION_RATE = 2.0
BYTES_PER_COMPRESSED = 28.0
COPY_BYTES = 1 << 30


# The presets: parameter shapes in forward order, exactly as
# ddp-hooks/benches/models/mod.rs writes them (keep the two in step; the counts are
# checked against PUBLISHED, as the Rust side checks its own).
def linear4():
    """4 x Linear(1024, 1024) with bias."""
    return [s for _ in range(4) for s in ([1024, 1024], [1024])]


def bert_base():
    """BERT-base: embeddings, 12 layers of hidden 768, FFN 3072, pooler."""
    h = 768
    s = [[30522, h], [512, h], [2, h], [h], [h]]
    for _ in range(12):
        for _ in range(4):
            s += [[h, h], [h]]
        s += [[h], [h], [3072, h], [3072], [h, 3072], [h], [h], [h]]
    s += [[h, h], [h]]
    return s


def gpt2_small():
    """GPT-2 small as Hugging Face lays it out (Conv1D weights in x out, tied output)."""
    d = 768
    s = [[50257, d], [1024, d]]
    for _ in range(12):
        s += [[d], [d], [d, 3 * d], [3 * d], [d, d], [d], [d], [d]]
        s += [[d, 4 * d], [4 * d], [4 * d, d], [d]]
    s += [[d], [d]]
    return s


PRESETS = [
    ("linear4x1024", linear4()),
    ("bert-base", bert_base()),
    ("gpt2-small", gpt2_small()),
]

PUBLISHED = {
    "linear4x1024": 4 * (1024 * 1024 + 1024),
    "bert-base": 109_482_240,
    "gpt2-small": 124_439_808,
}


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def compressed_elements(shapes, rank):
    """Elements of the tensors powerSGD_hook compresses at `rank` (its own test on the
    tensor viewed as shape[0] x rest)."""
    total = 0
    for s in shapes:
        k = numel(s)
        n = s[0] if s and s[0] > 0 else 1
        m = k // n
        r = min(n, m, rank)
        if r > 0 and (n + m) * r * MIN_COMPRESSION_RATE < n * m:
            total += k
    return total


def copy_bandwidth(torch):
    """Device-to-device copy bandwidth (bytes/s, read + write), median of 10."""
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()
    return 2.0 * COPY_BYTES / statistics.median(times)


def measure(torch, shapes, coeffs, register):
    """Median backward time (s) of a DDP model with the preset's parameters, after
    WARMUP steps, with the hook that `register(ddp)` installs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Shapes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.params = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.zeros(s, device="cuda")) for s in shapes]
            )

        def forward(self, cs):
            return torch.stack([(p * c).sum() for p, c in zip(self.params, cs)]).sum()

    ddp = DDP(Shapes(), device_ids=[0])
    register(ddp)
    times = []
    for _ in range(WARMUP + STEPS):
        ddp.zero_grad(set_to_none=True)
        loss = ddp(coeffs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del ddp, loss
    torch.cuda.empty_cache()
    return statistics.median(times[WARMUP:])


def run(out):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    for name, shapes in PRESETS:
        if sum(numel(s) for s in shapes) != PUBLISHED[name]:
            raise RuntimeError(f"preset {name} does not have its published parameter count")
    torch.cuda.set_device(0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            bw = copy_bandwidth(torch)
            nccl = torch.cuda.nccl.version()  # a tuple, or an int before PyTorch 1.12
            nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            print(
                f"pytorch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
                f"NCCL {nccl}; device copy bandwidth {bw / 1e9:.0f} GB/s",
                flush=True,
            )
            gen = torch.Generator(device="cuda").manual_seed(0)
            for name, shapes in PRESETS:
                coeffs = [
                    torch.randn(s, device="cuda", generator=gen) for s in shapes
                ]
                noop = measure(
                    torch, shapes, coeffs, lambda d: d.register_comm_hook(None, noop_hook)
                )
                for rank in RANKS:
                    bound_ms = BYTES_PER_COMPRESSED * compressed_elements(shapes, rank) / bw * 1e3
                    for path, batch in (("pytorch", False), ("pytorch-batched", True)):

                        def register(d, rank=rank, batch=batch):
                            state = psgd.PowerSGDState(
                                process_group=None,
                                matrix_approximation_rank=rank,
                                start_powerSGD_iter=START_ITER,
                                min_compression_rate=MIN_COMPRESSION_RATE,
                                batch_tensors_with_same_shape=batch,
                            )
                            d.register_comm_hook(state, psgd.powerSGD_hook)

                        try:
                            step = measure(torch, shapes, coeffs, register)
                        except TypeError as e:
                            # A PyTorch without batch_tensors_with_same_shape (before 1.13).
                            print(f"pytorch: {name} r{rank} {path} not measured ({e})")
                            continue
                        hook_ms = (step - noop) * 1e3
                        row = {
                            "preset": name,
                            "rank": rank,
                            "path": path,
                            "hook_ms": round(hook_ms, 4),
                            "bound_ms": round(bound_ms, 4),
                            "bound_ratio": round(hook_ms / bound_ms, 3),
                            "step_ms": round(step * 1e3, 4),
                            "noop_ms": round(noop * 1e3, 4),
                        }
                        line = json.dumps(row)
                        print(line, flush=True)
                        if out is not None:
                            out.write(line + "\n")
                            out.flush()
                del coeffs
                torch.cuda.empty_cache()
        finally:
            dist.destroy_process_group()
    print(
        f"pytorch: {STEPS} steps per row after {WARMUP} warm-up, medians; "
        f"{time.perf_counter() - started:.0f} s in all"
    )


def main():
    out_dir = os.environ.get("OUT")
    out = None
    try:
        if out_dir:
            out = open(os.path.join(out_dir, "pytorch_hooks.jsonl"), "w")
        run(out)
    except Exception as e:  # noqa: BLE001 - a reference run must never fail the check
        print(f"pytorch: skipped ({type(e).__name__}: {e})")
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
