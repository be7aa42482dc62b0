/* The CUDA C kernels of lowrank's CUDA backend, compiled at run time by NVRTC
   (`kernels.rs`: `SOURCE` is this file, through `include_str!`). No #include: see
   kernels.rs for why, and for the Rust copies of the #defines below, which the unit
   test `constants_match_the_source` checks against this file. */

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define LR_MAX_RANK 64

/* ---------------------------------------------------------------------------------- */
/* Conversions, on bit patterns; mirrors of the `half` crate (2.x) software paths.     */

__device__ __forceinline__ float lr_f16_to_f32(u16 h) {
    const u32 sign = ((u32)(h & 0x8000u)) << 16;
    const u32 exp = (u32)(h & 0x7c00u);
    const u32 man = (u32)(h & 0x03ffu);
    if (exp == 0x7c00u) {
        return __uint_as_float(man == 0u ? (sign | 0x7f800000u) : (sign | 0x7fc00000u | (man << 13)));
    }
    if (exp == 0u) {
        /* zero or subnormal: man * 2^-24, exact in f32 */
        const float mag = (float)man * 5.9604644775390625e-8f;
        return __uint_as_float(__float_as_uint(mag) | sign);
    }
    return __uint_as_float(sign | ((exp + 0x1c000u) << 13) | (man << 13));
}

__device__ __forceinline__ u16 lr_f32_to_f16(float f) {
    const u32 x = __float_as_uint(f);
    const u32 exp = x & 0x7f800000u;
    const u32 man = x & 0x007fffffu;
    const u32 hsign = (x & 0x80000000u) >> 16;
    if (exp == 0x7f800000u) {
        const u32 nan_bit = man == 0u ? 0u : 0x0200u;
        return (u16)(hsign | 0x7c00u | nan_bit | (man >> 13));
    }
    const int hexp = (int)(exp >> 23) - 127 + 15;
    if (hexp >= 0x1f) {
        return (u16)(hsign | 0x7c00u);
    }
    if (hexp <= 0) {
        if (14 - hexp > 24) {
            return (u16)hsign;
        }
        const u32 m = man | 0x00800000u;
        u32 hman = m >> (14 - hexp);
        const u32 round_bit = 1u << (13 - hexp);
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) {
            hman += 1u;
        }
        return (u16)(hsign | hman);
    }
    const u32 out = hsign | ((u32)hexp << 10) | (man >> 13);
    const u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) {
        return (u16)(out + 1u);
    }
    return (u16)out;
}

__device__ __forceinline__ float lr_bf16_to_f32(u16 h) {
    const u32 v = (u32)h;
    if ((v & 0x7fffu) > 0x7f80u) {
        return __uint_as_float((v | 0x0040u) << 16);
    }
    return __uint_as_float(v << 16);
}

__device__ __forceinline__ u16 lr_f32_to_bf16(float f) {
    const u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((x >> 16) | 0x0040u);
    }
    const u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) {
        return (u16)((x >> 16) + 1u);
    }
    return (u16)(x >> 16);
}

__device__ __forceinline__ u16 lr_f16_to_bf16(u16 h) { return lr_f32_to_bf16(lr_f16_to_f32(h)); }
__device__ __forceinline__ u16 lr_bf16_to_f16(u16 h) { return lr_f32_to_f16(lr_bf16_to_f32(h)); }

#define LR_GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

#define LR_CAST(NAME, ST, DT, CONV)                                                        \
    extern "C" __global__ void NAME(const ST* __restrict__ src, DT* __restrict__ dst, u64 n) { \
        LR_GRID_STRIDE(i, n) { dst[i] = CONV(src[i]); }                                    \
    }

LR_CAST(lr_cast_f32_f16, float, u16, lr_f32_to_f16)
LR_CAST(lr_cast_f32_bf16, float, u16, lr_f32_to_bf16)
LR_CAST(lr_cast_f16_f32, u16, float, lr_f16_to_f32)
LR_CAST(lr_cast_bf16_f32, u16, float, lr_bf16_to_f32)
LR_CAST(lr_cast_f16_bf16, u16, u16, lr_f16_to_bf16)
LR_CAST(lr_cast_bf16_f16, u16, u16, lr_bf16_to_f16)

/* ---------------------------------------------------------------------------------- */
/* Element-wise f32.                                                                   */

extern "C" __global__ void lr_add(float* __restrict__ y, const float* __restrict__ x, u64 n) {
    LR_GRID_STRIDE(i, n) { y[i] += x[i]; }
}

extern "C" __global__ void lr_scale(float* __restrict__ x, float alpha, u64 n) {
    LR_GRID_STRIDE(i, n) { x[i] *= alpha; }
}

/* flag_nonfinite: *flag = 1 when some x[i] has an all-ones exponent (an infinity or a
   NaN); never lowered. Each thread ORs its elements, then raises the flag once. */
extern "C" __global__ void lr_flag_nonfinite(const float* __restrict__ x, float* flag, u64 n) {
    u32 bad = 0u;
    LR_GRID_STRIDE(i, n) { bad |= (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u; }
    if (bad) {
        atomicExch(flag, 1.0f);
    }
}

/* copy_unflagged: dst = src unless *flag != 0. */
extern "C" __global__ void lr_copy_unflagged(const float* __restrict__ src, float* __restrict__ dst,
                                             const float* __restrict__ flag, u64 n) {
    if (*flag != 0.0f) {
        return;
    }
    LR_GRID_STRIDE(i, n) { dst[i] = src[i]; }
}

/* ---------------------------------------------------------------------------------- */
/* pqt_error: for every (b, i, j): s = sum_k P[b][k*n + i] * Q[b][k*m + j] (k ascending,
   fused multiply-add from 0); x = M[b][i*m + j]; M = s; E = x - s, unless `flag` is
   not null and *flag != 0 (then E is not written).
   A block of 256 threads computes a tile of 32 rows x 128 columns of one matrix; thread
   (tx, ty) = (tid % 32, tid / 32) owns the 4 x 4 elements of rows ty*4 .. ty*4+3 and
   columns tx*4 .. tx*4+3, so a warp reads and writes 512 contiguous bytes of one row.
   The thread loads its 16 elements of M first (16-byte loads when every row of M and E
   starts 16-byte aligned, else element by element), then the tile's P rows and Q
   columns are staged in dynamic shared memory (r*32 then r*128 floats), so the loads of
   M are in flight while P and Q arrive. Tiles are taken grid-stride.
   (A first version, one column and 8 rows a thread with each element's load, store and
   store in sequence, moved 12 bytes an element at 240 GB/s on an H200: 6% of its copy
   bandwidth.)                                                                        */

#define PE_ROWS 32
#define PE_COLS 128
#define PE_THREADS 256

extern "C" __global__ void __launch_bounds__(PE_THREADS) lr_pqt_error(
    const float* __restrict__ p, const float* __restrict__ q, float* __restrict__ mat,
    float* __restrict__ err, u64 batch, u64 n, u64 m, u32 r, const float* __restrict__ flag) {
    extern __shared__ float4 pe_smem[];
    const bool keep_err = flag != nullptr && *flag != 0.0f;
    float* sp = reinterpret_cast<float*>(pe_smem);
    float* sq = sp + (u64)r * PE_ROWS;
    const u32 tid = threadIdx.x;
    const u32 tx = tid % 32u;
    const u32 ty = tid / 32u;
    const u64 row_tiles = (n + PE_ROWS - 1) / PE_ROWS;
    const u64 col_tiles = (m + PE_COLS - 1) / PE_COLS;
    const u64 per_matrix = row_tiles * col_tiles;
    const u64 tiles = batch * per_matrix;
    const bool vec = (m % 4u) == 0u && (((u64)mat | (u64)err) & 15u) == 0u;
    for (u64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const u64 b = tile / per_matrix;
        const u64 t = tile - b * per_matrix;
        const u64 i0 = (t / col_tiles) * PE_ROWS;
        const u64 j0 = (t % col_tiles) * PE_COLS;
        const u64 j = j0 + tx * 4u;
        const float* pb = p + b * n * r;
        const float* qb = q + b * m * r;
        /* this thread's elements of M, loaded before anything else */
        float x[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const u64 i = i0 + ty * 4u + a;
            const u64 at = (b * n + i) * m + j;
            if (vec) {
                if (i < n && j < m) {
                    const float4 v = *reinterpret_cast<const float4*>(mat + at);
                    x[a][0] = v.x;
                    x[a][1] = v.y;
                    x[a][2] = v.z;
                    x[a][3] = v.w;
                } else {
                    x[a][0] = x[a][1] = x[a][2] = x[a][3] = 0.0f;
                }
            } else {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    x[a][c] = (i < n && j + c < m) ? mat[at + c] : 0.0f;
                }
            }
        }
        __syncthreads(); /* the previous tile is done with the shared arrays */
        for (u32 idx = tid; idx < r * PE_ROWS; idx += PE_THREADS) {
            const u32 k = idx / PE_ROWS;
            const u64 i = i0 + idx % PE_ROWS;
            sp[idx] = i < n ? pb[(u64)k * n + i] : 0.0f;
        }
        for (u32 idx = tid; idx < r * PE_COLS; idx += PE_THREADS) {
            const u32 k = idx / PE_COLS;
            const u64 jj = j0 + idx % PE_COLS;
            sq[idx] = jj < m ? qb[(u64)k * m + jj] : 0.0f;
        }
        __syncthreads();
        float acc[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                acc[a][c] = 0.0f;
            }
        }
        for (u32 k = 0; k < r; ++k) {
            /* the whole warp shares ty (a broadcast); tx reads consecutive float4s */
            const float4 pv = pe_smem[(k * PE_ROWS + ty * 4u) / 4u];
            const float4 qv = pe_smem[(r * PE_ROWS + k * PE_COLS + tx * 4u) / 4u];
            const float pr[4] = {pv.x, pv.y, pv.z, pv.w};
            const float qc[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
            for (int a = 0; a < 4; ++a) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    acc[a][c] = fmaf(pr[a], qc[c], acc[a][c]);
                }
            }
        }
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const u64 i = i0 + ty * 4u + a;
            const u64 at = (b * n + i) * m + j;
            if (vec) {
                if (i < n && j < m) {
                    float4 s, e;
                    s.x = acc[a][0];
                    s.y = acc[a][1];
                    s.z = acc[a][2];
                    s.w = acc[a][3];
                    e.x = x[a][0] - acc[a][0];
                    e.y = x[a][1] - acc[a][1];
                    e.z = x[a][2] - acc[a][2];
                    e.w = x[a][3] - acc[a][3];
                    *reinterpret_cast<float4*>(mat + at) = s;
                    if (!keep_err) {
                        *reinterpret_cast<float4*>(err + at) = e;
                    }
                }
            } else {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    if (i < n && j + c < m) {
                        mat[at + c] = acc[a][c];
                        if (!keep_err) {
                            err[at + c] = x[a][c] - acc[a][c];
                        }
                    }
                }
            }
        }
    }
}

/* ---------------------------------------------------------------------------------- */
/* orthogonalize: the CPU's rule (lowrank/src/cpu/kernels.rs, `gram_schmidt`):
   1. prescale: a column whose sum of squares is not finite or below LR_TINY_SS is read
      element by element: any NaN/inf makes the whole matrix NaN; else it is scaled by a
      power of two into [0.5, 1) (exact) and its eps scaled with it;
   2. pass 1: modified Gram-Schmidt, each column normalised to unit length; an exactly
      zero column stays zero; ratio[k] = norm after projection / norm before the pass;
   3. pass 2: the same, a column set to zero when ratio1 * ratio2 <= tol;
   4. eps > 0: column k scaled by norm1 / (norm1 + eps_k).
   One block per n x r column-major factor (grid-stride over the batch). Thread t owns
   elements t, t + blockDim.x, ... of every column, so all global accesses are thread-
   private; only reductions cross threads, through shared memory, and every thread reads
   the same partial sums in the same order, so every decision is uniform across the
   block. The dot products <c_i, c_j> of one step are all taken before any c_j is
   updated: each c_j only depends on c_i in that step, so this is exactly the sequential
   rule. Factors with n < OG_SERIAL_N take a serial thread-per-matrix path instead.      */

#define OG_MAX_WARPS 32
#define OG_SERIAL_N 8
#define LR_REFILL_ATTEMPTS 3ull
#define LR_TINY_SS 8.673617e-19f
#define LR_FLT_MAX 3.402823466e38

__device__ __forceinline__ bool lr_isfinite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

/* 2^k for k in -126..=127, exactly. */
__device__ __forceinline__ float lr_pow2(int k) {
    return __uint_as_float((u32)(k + 127) << 23);
}

/* The two power-of-two factors that bring amax (finite, > 0) into [0.5, 1). */
__device__ void lr_pow2_scale(float amax, float* s1, float* s2) {
    const u32 bits = __float_as_uint(amax);
    const int exp = (int)(bits >> 23);
    int e;
    if (exp == 0) {
        const u32 mant = bits & 0x7fffffu;
        e = (32 - __clz(mant)) - 149;
    } else {
        e = exp - 126;
    }
    const int half = (-e) / 2;
    const int rest = -e - half;
    *s1 = lr_pow2(half);
    *s2 = lr_pow2(rest);
}

__device__ __forceinline__ float lr_scaled_eps(float eps, float s1, float s2) {
    const double v = (double)eps * (double)s1 * (double)s2;
    return (float)(v < LR_FLT_MAX ? v : LR_FLT_MAX);
}

/* n < OG_SERIAL_N: every CPU instruction set (8 or 16 lanes) runs its scalar tail, so
   this thread-per-matrix path repeats the CPU's exact operations, unfused and in its
   order (s += a*b from 0; c *= 1/norm; c_j -= d*c_i), for bit-identical results. */
__device__ float lr_serial_dot(const float* a, const float* b, u64 n) {
    float s = 0.0f;
    for (u64 t = 0; t < n; ++t) {
        s = __fadd_rn(s, __fmul_rn(a[t], b[t]));
    }
    return s;
}

__device__ void lr_serial_scale(float* c, float alpha, u64 n) {
    for (u64 t = 0; t < n; ++t) {
        c[t] = __fmul_rn(c[t], alpha);
    }
}

__device__ void lr_serial_pass(float* x, u64 n, u32 r, const float* prior, float tol,
                               float* norms, float* ratios) {
    float before[LR_MAX_RANK];
    for (u32 k = 0; k < r; ++k) {
        const float* c = x + (u64)k * n;
        before[k] = __fsqrt_rn(lr_serial_dot(c, c, n));
    }
    for (u32 i = 0; i < r; ++i) {
        float* ci = x + (u64)i * n;
        const float norm = __fsqrt_rn(lr_serial_dot(ci, ci, n));
        const float ratio = before[i] > 0.0f ? __fdiv_rn(norm, before[i]) : 0.0f;
        norms[i] = 0.0f;
        ratios[i] = 0.0f;
        if (norm == 0.0f || __fmul_rn(prior[i], ratio) <= tol || !lr_isfinite(norm)) {
            for (u64 t = 0; t < n; ++t) {
                ci[t] = 0.0f;
            }
            continue;
        }
        norms[i] = norm;
        ratios[i] = ratio;
        lr_serial_scale(ci, __fdiv_rn(1.0f, norm), n);
        for (u32 j = i + 1u; j < r; ++j) {
            float* cj = x + (u64)j * n;
            const float d = lr_serial_dot(ci, cj, n);
            for (u64 t = 0; t < n; ++t) {
                cj[t] = __fsub_rn(cj[t], __fmul_rn(d, ci[t]));
            }
        }
    }
}

__device__ void lr_gram_schmidt_serial(float* x, u64 n, u32 r, float eps, float tol) {
    float eps_k[LR_MAX_RANK];
    for (u32 k = 0; k < r; ++k) {
        eps_k[k] = eps;
        float* c = x + (u64)k * n;
        const float ss = lr_serial_dot(c, c, n);
        if (lr_isfinite(ss) && ss >= LR_TINY_SS) {
            continue;
        }
        float amax = 0.0f;
        bool bad = false;
        for (u64 t = 0; t < n; ++t) {
            bad = bad || !lr_isfinite(c[t]);
            amax = fmaxf(amax, fabsf(c[t]));
        }
        if (bad) {
            for (u64 t = 0; t < n * r; ++t) {
                x[t] = __uint_as_float(0x7fc00000u);
            }
            return;
        }
        if (amax == 0.0f) {
            continue;
        }
        float s1, s2;
        lr_pow2_scale(amax, &s1, &s2);
        lr_serial_scale(c, s1, n);
        lr_serial_scale(c, s2, n);
        eps_k[k] = lr_scaled_eps(eps, s1, s2);
    }
    float ones[LR_MAX_RANK], norms[LR_MAX_RANK], ratios[LR_MAX_RANK], unused[LR_MAX_RANK];
    for (u32 k = 0; k < r; ++k) {
        ones[k] = 1.0f;
    }
    lr_serial_pass(x, n, r, ones, 0.0f, norms, ratios);
    float lengths[LR_MAX_RANK];
    for (u32 k = 0; k < r; ++k) {
        lengths[k] = norms[k] == 0.0f ? 0.0f : __fdiv_rn(norms[k], __fadd_rn(norms[k], eps_k[k]));
    }
    lr_serial_pass(x, n, r, ratios, tol, norms, unused);
    if (eps != 0.0f) {
        for (u32 k = 0; k < r; ++k) {
            if (lengths[k] != 1.0f) {
                lr_serial_scale(x + (u64)k * n, lengths[k], n);
            }
        }
    }
}

/* Complete in lane 0 only. */
__device__ __forceinline__ float lr_warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_down_sync(0xffffffffu, v, off);
    }
    return v;
}

/* This thread's share of <a, b>. */
__device__ __forceinline__ float lr_own_dot(const float* a, const float* b, u64 n) {
    float s = 0.0f;
    for (u64 t = threadIdx.x; t < n; t += blockDim.x) {
        s = fmaf(a[t], b[t], s);
    }
    return s;
}

/* The block's sum of one value per thread; the same bits in every thread. */
__device__ float lr_block_sum(float v, float* red) {
    v = lr_warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31u) == 0u) {
        red[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    const u32 warps = blockDim.x >> 5;
    float s = 0.0f;
    for (u32 w = 0; w < warps; ++w) {
        s += red[w];
    }
    return s;
}

/* The block's maximum of one value per thread (exact, so order does not matter). */
__device__ float lr_block_max(float v, float* red) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, off));
    }
    __syncthreads();
    if ((threadIdx.x & 31u) == 0u) {
        red[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    const u32 warps = blockDim.x >> 5;
    float s = 0.0f;
    for (u32 w = 0; w < warps; ++w) {
        s = fmaxf(s, red[w]);
    }
    return s;
}

__device__ void lr_block_scale(float* c, float alpha, u64 n) {
    for (u64 t = threadIdx.x; t < n; t += blockDim.x) {
        c[t] *= alpha;
    }
}

/* One pass of the block path; `prior`, `norms`, `ratios` and `before` are shared. */
__device__ void lr_block_pass(float* base, u64 n, u32 r, const float* prior, float tol,
                              float* norms, float* ratios, float* part, float* before,
                              float* red) {
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    const u32 warps = blockDim.x >> 5;
    __syncthreads(); /* earlier readers of part and before are done */
    for (u32 k = 0; k < r; ++k) {
        const float* c = base + (u64)k * n;
        const float s = lr_warp_sum(lr_own_dot(c, c, n));
        if (lane == 0u) {
            part[warp * LR_MAX_RANK + k] = s;
        }
    }
    __syncthreads();
    /* Strided: a block may have fewer threads than columns (32 threads for r = 64). */
    for (u32 k = threadIdx.x; k < r; k += blockDim.x) {
        float s = 0.0f;
        for (u32 w = 0; w < warps; ++w) {
            s += part[w * LR_MAX_RANK + k];
        }
        before[k] = sqrtf(s);
    }
    __syncthreads();
    for (u32 i = 0; i < r; ++i) {
        float* ci = base + (u64)i * n;
        const float norm = sqrtf(lr_block_sum(lr_own_dot(ci, ci, n), red));
        const float ratio = before[i] > 0.0f ? norm / before[i] : 0.0f;
        const bool zero = norm == 0.0f || prior[i] * ratio <= tol || !lr_isfinite(norm);
        __syncthreads(); /* every thread has read prior[i] (it may alias ratios) */
        if (threadIdx.x == 0u) {
            norms[i] = zero ? 0.0f : norm;
            ratios[i] = zero ? 0.0f : ratio;
        }
        if (zero) {
            for (u64 t = threadIdx.x; t < n; t += blockDim.x) {
                ci[t] = 0.0f;
            }
            continue;
        }
        lr_block_scale(ci, 1.0f / norm, n);
        if (i + 1u < r) {
            /* part is free: its last readers finished before lr_block_sum's barriers */
            for (u32 j = i + 1u; j < r; ++j) {
                const float d = lr_warp_sum(lr_own_dot(ci, base + (u64)j * n, n));
                if (lane == 0u) {
                    part[warp * LR_MAX_RANK + j] = d;
                }
            }
            __syncthreads();
            for (u32 j = i + 1u; j < r; ++j) {
                float d = 0.0f;
                for (u32 w = 0; w < warps; ++w) {
                    d += part[w * LR_MAX_RANK + j];
                }
                float* cj = base + (u64)j * n;
                for (u64 t = threadIdx.x; t < n; t += blockDim.x) {
                    cj[t] = fmaf(-d, ci[t], cj[t]);
                }
            }
        }
    }
    __syncthreads(); /* norms and ratios are complete */
}

/* The shared scratch of the block path. */
struct LrOgShared {
    float part[OG_MAX_WARPS * LR_MAX_RANK];
    float before[LR_MAX_RANK];
    float red[OG_MAX_WARPS];
    float eps_k[LR_MAX_RANK];
    float ones[LR_MAX_RANK];
    float norms[LR_MAX_RANK];
    float ratios[LR_MAX_RANK];
    float lengths[LR_MAX_RANK];
};

/* Gram-Schmidt twice on one matrix by the whole block (block path). */
__device__ void lr_orthogonalize_block(float* base, u64 n, u32 r, float eps, float tol,
                                       LrOgShared* sh) {
    __syncthreads(); /* the previous matrix is done with the shared arrays */
    for (u32 k = threadIdx.x; k < r; k += blockDim.x) {
        sh->eps_k[k] = eps;
        sh->ones[k] = 1.0f;
    }
    bool nan_matrix = false;
    for (u32 k = 0; k < r; ++k) {
        float* c = base + (u64)k * n;
        const float ss = lr_block_sum(lr_own_dot(c, c, n), sh->red);
        if (lr_isfinite(ss) && ss >= LR_TINY_SS) {
            continue;
        }
        float own_max = 0.0f, own_bad = 0.0f;
        for (u64 t = threadIdx.x; t < n; t += blockDim.x) {
            own_bad += lr_isfinite(c[t]) ? 0.0f : 1.0f;
            own_max = fmaxf(own_max, fabsf(c[t]));
        }
        const float bad = lr_block_sum(own_bad, sh->red);
        const float amax = lr_block_max(own_max, sh->red);
        if (bad != 0.0f) {
            nan_matrix = true;
            break;
        }
        if (amax == 0.0f) {
            continue;
        }
        float s1, s2;
        lr_pow2_scale(amax, &s1, &s2);
        lr_block_scale(c, s1, n);
        lr_block_scale(c, s2, n);
        if (threadIdx.x == 0u) {
            sh->eps_k[k] = lr_scaled_eps(eps, s1, s2);
        }
    }
    if (nan_matrix) {
        for (u64 t = threadIdx.x; t < n * r; t += blockDim.x) {
            base[t] = __uint_as_float(0x7fc00000u);
        }
        return;
    }
    lr_block_pass(base, n, r, sh->ones, 0.0f, sh->norms, sh->ratios, sh->part, sh->before,
                  sh->red);
    for (u32 k = threadIdx.x; k < r; k += blockDim.x) {
        const float nk = sh->norms[k];
        sh->lengths[k] = nk == 0.0f ? 0.0f : nk / (nk + sh->eps_k[k]);
    }
    /* lr_block_pass starts with a barrier, so lengths is written before ratios'
       reuse below and read after the pass's closing barrier. */
    lr_block_pass(base, n, r, sh->ratios, tol, sh->norms, sh->ratios, sh->part, sh->before,
                  sh->red);
    if (eps != 0.0f) {
        for (u32 k = 0; k < r; ++k) {
            if (sh->lengths[k] != 1.0f) {
                lr_block_scale(base + (u64)k * n, sh->lengths[k], n);
            }
        }
    }
}

/* The refill values (lowrank::refill_value, bit for bit): SplitMix64's finaliser, 24
   bits scaled exactly into [-1, 1). */
__device__ __forceinline__ u64 lr_mix(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float lr_refill_value(u64 key, u64 attempt, u64 index) {
    const u64 h = lr_mix(lr_mix(key ^ attempt) ^ index);
    return __fsub_rn(__fmul_rn((float)(h >> 40), 1.1920928955078125e-7f), 1.0f);
}

/* Serial path: refills the zero columns of one matrix (one thread) while fewer than
   min(n, r) columns are non-zero, re-orthogonalising after each attempt. */
__device__ void lr_refill_serial(float* x, u64 n, u32 r, float eps, float tol, u64 key) {
    const u32 full = n < (u64)r ? (u32)n : r;
    for (u64 attempt = 0; attempt < LR_REFILL_ATTEMPTS; ++attempt) {
        u32 nonzero = 0;
        for (u32 k = 0; k < r; ++k) {
            bool any = false;
            for (u64 t = 0; t < n; ++t) {
                any = any || x[(u64)k * n + t] != 0.0f;
            }
            nonzero += any ? 1u : 0u;
        }
        if (nonzero >= full) {
            return;
        }
        for (u32 k = 0; k < r; ++k) {
            bool any = false;
            for (u64 t = 0; t < n; ++t) {
                any = any || x[(u64)k * n + t] != 0.0f;
            }
            if (!any) {
                for (u64 t = 0; t < n; ++t) {
                    x[(u64)k * n + t] = lr_refill_value(key, attempt, (u64)k * n + t);
                }
            }
        }
        lr_gram_schmidt_serial(x, n, r, eps, tol);
    }
}

/* Block path of the refill: the whole block counts the non-zero columns of one matrix. */
__device__ void lr_refill_block(float* base, u64 n, u32 r, float eps, float tol, u64 key,
                                LrOgShared* sh) {
    const u32 full = n < (u64)r ? (u32)n : r;
    for (u64 attempt = 0; attempt < LR_REFILL_ATTEMPTS; ++attempt) {
        __syncthreads(); /* the orthogonalisation before is done with lengths */
        /* lengths[k] (free between orthogonalisations) says whether column k is zero. */
        u32 nonzero = 0;
        for (u32 k = 0; k < r; ++k) {
            const float* c = base + (u64)k * n;
            float own = 0.0f;
            for (u64 t = threadIdx.x; t < n; t += blockDim.x) {
                own += c[t] != 0.0f ? 1.0f : 0.0f;
            }
            const float count = lr_block_sum(own, sh->red);
            nonzero += count != 0.0f ? 1u : 0u;
            if (threadIdx.x == 0u) {
                sh->lengths[k] = count != 0.0f ? 0.0f : 1.0f;
            }
        }
        __syncthreads();
        if (nonzero >= full) {
            return;
        }
        for (u32 k = 0; k < r; ++k) {
            if (sh->lengths[k] != 0.0f) {
                for (u64 t = threadIdx.x; t < n; t += blockDim.x) {
                    base[(u64)k * n + t] = lr_refill_value(key, attempt, (u64)k * n + t);
                }
            }
        }
        __syncthreads(); /* every thread has read lengths and written its values */
        lr_orthogonalize_block(base, n, r, eps, tol, sh);
    }
}

/* The serial path (n < OG_SERIAL_N), one thread a matrix, in a kernel of its own: its
   per-thread arrays (6 x 64 floats) take 1.5 KiB of local memory a thread, and the
   driver reserves local memory for every thread the device can hold (about 0.4 GB on an
   H200) once a kernel that needs it is launched. The block path needs none, so a
   workload whose factors all have n >= 8 never pays for it. */
extern "C" __global__ void __launch_bounds__(128) lr_orthogonalize_serial(
    float* __restrict__ x, u64 batch, u64 n, u32 r, float eps, float tol, u64 key,
    u32 refill) {
    LR_GRID_STRIDE(b, batch) {
        lr_gram_schmidt_serial(x + b * n * r, n, r, eps, tol);
        if (refill != 0u) {
            lr_refill_serial(x + b * n * r, n, r, eps, tol, key);
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024) lr_orthogonalize(
    float* __restrict__ x, u64 batch, u64 n, u32 r, float eps, float tol, u64 key,
    u32 refill) {
    __shared__ LrOgShared sh;
    for (u64 b = blockIdx.x; b < batch; b += gridDim.x) {
        float* base = x + b * n * r;
        lr_orthogonalize_block(base, n, r, eps, tol, &sh);
        if (refill != 0u) {
            lr_refill_block(base, n, r, eps, tol, key, &sh);
        }
    }
}
