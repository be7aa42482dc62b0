/* The CUDA C kernels of pipe's CUDA layers, compiled at run time by NVRTC (`device.rs`:
   `SOURCE` is this file, through `include_str!`). No #include, so NVRTC needs no include
   path. Every index is 64-bit and every element-wise loop is grid-stride, so any grid
   works. Arithmetic that must match the CPU layers bit for bit (dropout, the batch-norm
   element-wise steps) is written with the `__f*_rn` / `__d*_rn` intrinsics, which are
   never contracted into fused multiply-adds, in the CPU code's order. */

typedef unsigned long long u64;

#define PP_REDUCE_THREADS 256

/* ---------------------------------------------------------------------------------- */
/* The counter-based random stream of `rng.rs` (SplitMix64's mix), for dropout.         */

#define PP_GOLDEN 0x9E3779B97F4A7C15ull
#define PP_SAMPLE 0x8CB92BA72F3D8DD7ull

__device__ __forceinline__ u64 pp_mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* ---------------------------------------------------------------------------------- */
/* Element-wise.                                                                       */

/* y[i] = b[i % cols] over rows x cols: Linear's bias, before the product adds x W. */
extern "C" __global__ void pp_fill_rows(float* y, const float* b, u64 rows, u64 cols) {
    const u64 n = rows * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        y[i] = b[i % cols];
    }
}

/* y += x (gradient accumulation). */
extern "C" __global__ void pp_add(float* y, const float* x, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        y[i] = __fadd_rn(y[i], x[i]);
    }
}

/* x = max(x, 0) in place, as f32::max (a NaN input gives 0, as Rust's max does). */
extern "C" __global__ void pp_relu(float* x, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        x[i] = fmaxf(x[i], 0.0f);
    }
}

/* dy = 0 where y <= 0, in place (ReLU's backward from its saved output). */
extern "C" __global__ void pp_relu_backward(float* dy, const float* y, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        if (y[i] <= 0.0f) dy[i] = 0.0f;
    }
}

/* Dropout's mask, in place: element e of row r (global sample offset + r) is zeroed when
   its uniform draw is below p, else scaled. `layer_key` is `Stream::new(seed, step,
   layer)`'s key, so the mask equals the CPU layer's. */
extern "C" __global__ void pp_dropout(float* x, u64 rows, u64 per_row, u64 layer_key,
                                      u64 offset, float p, float scale) {
    const u64 n = rows * per_row;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 row = i / per_row, e = i % per_row;
        const u64 key = pp_mix(layer_key ^ ((offset + row) * PP_SAMPLE));
        const u64 bits = pp_mix(key + (e + 1ull) * PP_GOLDEN);
        const float u = (float)(bits >> 40) * (1.0f / 16777216.0f);
        x[i] = u < p ? 0.0f : __fmul_rn(x[i], scale);
    }
}

/* out[c] (+)= sum over rows of x[row, c], one thread a column, rows in order (f32, as the
   CPU's bias gradient). */
extern "C" __global__ void pp_col_sum(float* out, const float* x, u64 rows, u64 cols, int accumulate) {
    for (u64 c = blockIdx.x * (u64)blockDim.x + threadIdx.x; c < cols; c += (u64)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (u64 r = 0; r < rows; ++r) s = __fadd_rn(s, x[r * cols + c]);
        out[c] = accumulate ? __fadd_rn(out[c], s) : s;
    }
}

/* Spins for about `cycles` clock cycles: the tests' stand-in for a slow producer. */
extern "C" __global__ void pp_spin(u64 cycles) {
    const long long start = clock64();
    while ((u64)(clock64() - start) < cycles) {
    }
}

/* ---------------------------------------------------------------------------------- */
/* Batch norm over [n, c, l] (row-major), one block per feature, reductions in f64 in a   */
/* fixed order (each thread strides the feature's elements, then a tree in shared        */
/* memory), so a result does not depend on the stream or the run.                         */

__device__ __forceinline__ u64 pp_bn_index(u64 k, u64 ch, u64 c, u64 l) {
    /* The k-th element of feature ch: sample k / l, position k % l. */
    return ((k / l) * c + ch) * l + (k % l);
}

__device__ double pp_block_sum(double v, double* shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = PP_REDUCE_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shared[threadIdx.x] = __dadd_rn(shared[threadIdx.x], shared[threadIdx.x + s]);
        __syncthreads();
    }
    const double total = shared[0];
    __syncthreads();
    return total;
}

/* Per feature: mean, biased variance (two passes, as the CPU) and the sums of x and x^2
   (for deferred statistics: added to sum / sum_sq when `track` is set). */
extern "C" __global__ void pp_bn_stats(const float* x, double* mean, double* var, float* inv_std,
                                       double* sum, double* sum_sq, double eps, u64 n, u64 c,
                                       u64 l, int track) {
    __shared__ double shared[PP_REDUCE_THREADS];
    const u64 ch = blockIdx.x;
    const u64 count = n * l;
    double s = 0.0, q = 0.0;
    for (u64 k = threadIdx.x; k < count; k += PP_REDUCE_THREADS) {
        const double v = (double)x[pp_bn_index(k, ch, c, l)];
        s = __dadd_rn(s, v);
        q = __dadd_rn(q, __dmul_rn(v, v));
    }
    s = pp_block_sum(s, shared);
    q = pp_block_sum(q, shared);
    const double m = __ddiv_rn(s, (double)(count > 0 ? count : 1));
    double d = 0.0;
    for (u64 k = threadIdx.x; k < count; k += PP_REDUCE_THREADS) {
        const double v = __dadd_rn((double)x[pp_bn_index(k, ch, c, l)], -m);
        d = __dadd_rn(d, __dmul_rn(v, v));
    }
    d = pp_block_sum(d, shared);
    if (threadIdx.x == 0) {
        mean[ch] = m;
        var[ch] = __ddiv_rn(d, (double)(count > 0 ? count : 1));
        inv_std[ch] = (float)__ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(var[ch], eps)));
        if (track) {
            sum[ch] = __dadd_rn(sum[ch], s);
            sum_sq[ch] = __dadd_rn(sum_sq[ch], q);
        }
    }
}

/* Training forward: x_hat = (x - mean) * inv_std, y = w * x_hat + b. */
extern "C" __global__ void pp_bn_forward(float* y, float* x_hat, const float* x, const double* mean,
                                         const float* inv_std, const float* w, const float* b,
                                         u64 n, u64 c, u64 l) {
    const u64 total = n * c * l;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 ch = (i / l) % c;
        const float inv = inv_std[ch];
        const float m = (float)mean[ch];
        const float xh = __fmul_rn(__fsub_rn(x[i], m), inv);
        x_hat[i] = xh;
        y[i] = __fadd_rn(__fmul_rn(w[ch], xh), b[ch]);
    }
}

/* Evaluation forward with the running statistics. */
extern "C" __global__ void pp_bn_eval(float* y, const float* x, const float* rm, const float* rv,
                                      const float* w, const float* b, float eps, u64 n, u64 c, u64 l) {
    const u64 total = n * c * l;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 ch = (i / l) % c;
        const float t = __fmul_rn(w[ch], __fsub_rn(x[i], rm[ch]));
        y[i] = __fadd_rn(__fdiv_rn(t, __fsqrt_rn(__fadd_rn(rv[ch], eps))), b[ch]);
    }
}

/* running = (1 - m) running + m stat (times `unbiased` for the variance), in f64. With
   `from_sums` the statistics are computed from the accumulated sums over `count`. */
extern "C" __global__ void pp_bn_running(float* rm, float* rv, const double* mean, const double* var,
                                         double momentum, double unbiased, double count,
                                         int from_sums, u64 c) {
    for (u64 ch = blockIdx.x * (u64)blockDim.x + threadIdx.x; ch < c; ch += (u64)gridDim.x * blockDim.x) {
        double m = mean[ch], v = var[ch];
        if (from_sums) {
            m = __ddiv_rn(mean[ch], count);
            v = fmax(__dadd_rn(__ddiv_rn(var[ch], count), -__dmul_rn(m, m)), 0.0);
        }
        const double keep = __dadd_rn(1.0, -momentum);
        rm[ch] = (float)__dadd_rn(__dmul_rn(keep, (double)rm[ch]), __dmul_rn(momentum, m));
        rv[ch] = (float)__dadd_rn(__dmul_rn(keep, (double)rv[ch]), __dmul_rn(__dmul_rn(momentum, v), unbiased));
    }
}

/* Backward, per feature: sum dy and sum dy * x_hat (f64, rounded to f32), added to the
   bias and weight gradients, and kept for the input gradient. */
extern "C" __global__ void pp_bn_backward_sums(const float* dy, const float* x_hat, float* sum_dy,
                                               float* sum_dy_xhat, float* bias_grad, float* weight_grad,
                                               u64 n, u64 c, u64 l) {
    __shared__ double shared[PP_REDUCE_THREADS];
    const u64 ch = blockIdx.x;
    const u64 count = n * l;
    double s = 0.0, t = 0.0;
    for (u64 k = threadIdx.x; k < count; k += PP_REDUCE_THREADS) {
        const u64 i = pp_bn_index(k, ch, c, l);
        s = __dadd_rn(s, (double)dy[i]);
        t = __dadd_rn(t, __dmul_rn((double)dy[i], (double)x_hat[i]));
    }
    s = pp_block_sum(s, shared);
    t = pp_block_sum(t, shared);
    if (threadIdx.x == 0) {
        sum_dy[ch] = (float)s;
        sum_dy_xhat[ch] = (float)t;
        bias_grad[ch] = __fadd_rn(bias_grad[ch], (float)s);
        weight_grad[ch] = __fadd_rn(weight_grad[ch], (float)t);
    }
}

/* dx = w inv / cnt (cnt dy - sum_dy - x_hat sum_dy_xhat), in the CPU's order. */
extern "C" __global__ void pp_bn_backward_dx(float* dx, const float* dy, const float* x_hat,
                                             const float* inv_std, const float* w, const float* sum_dy,
                                             const float* sum_dy_xhat, u64 n, u64 c, u64 l) {
    const u64 total = n * c * l;
    const float cnt = (float)(n * l > 0 ? n * l : 1);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 ch = (i / l) % c;
        const float a = __fdiv_rn(__fmul_rn(w[ch], inv_std[ch]), cnt);
        const float inner = __fsub_rn(__fsub_rn(__fmul_rn(cnt, dy[i]), sum_dy[ch]), __fmul_rn(x_hat[i], sum_dy_xhat[ch]));
        dx[i] = __fmul_rn(a, inner);
    }
}
