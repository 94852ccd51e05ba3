// A one-row GEMV in CUDA C: y[n] = W[n, :] . x, bf16 in and out, fp32 sums (kernels/cuda_gemv.py builds and calls
// it: specla::row_gemv's CUDA kernel, and benchmarks/gemv_cuda_gpu.py's subject). A prologue may form x first, once per
// block into shared memory after the wait (formed per warp, an H200 pass took 0.24 ms longer), each value in fp32
// rounded once to bf16 as the op's reference rounds it:
//   SWIGLU      x = silu(gate) * up of a packed [gate, up] row of 2K (an MLP's down projection);
//   GATED_NORM  x = r * rsqrt(mean(r^2 over its head) + eps) * norm_weight * silu(g) of a row r of K / D heads of D
//               values and its gate g (fla's gated output norm; o_proj).
//
// Each warp owns ROWS rows of W [N, K] (row-major). Every lane first issues all of its weight loads, 16 bytes
// each (lane l reads 16-byte chunks l, l + 32, ... of each row: CHUNKS = K / 256 of them), into registers: the
// weights depend on nothing upstream, so with programmatic dependent launch (PDL) they stream in while the kernel
// before is still finishing. Only then does the warp wait for that kernel (griddepcontrol.wait) and read x, sum
// its products in fp32, reduce across the warp with shuffles and store one bf16 per row.
//
// Built with nvcc (-arch=sm_90) into a shared library and called through ctypes with raw device pointers and the
// caller's CUDA stream (so a CUDA graph being captured on that stream records the launches).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

// One 16-byte weight load (read-only: ld.global.nc). STREAMING: not kept in L1 (the weights are read once per pass).
template <bool STREAMING>
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
    uint4 v;
    if (STREAMING) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else {
        asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    }
    return v;
}

enum Prologue { NONE = 0, SWIGLU = 1, GATED_NORM = 2 };

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// The block's x into ``staged`` (K / 8 chunks of 16 bytes), formed by PROLOGUE from ``x`` (and ``gate``,
// ``norm_weight``); ``scratch`` holds K / 8 + K / D floats. Each thread handles chunks threadIdx.x + j * blockDim.x,
// four at a time so that their loads are in flight together.
template <int PROLOGUE>
__device__ __forceinline__ void stage_x(uint4* staged, float* scratch, const __nv_bfloat16* x, const __nv_bfloat16* gate,
                                        const __nv_bfloat16* norm_weight, int k, int dim, float eps) {
    const int chunks = k / 8;
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    if (PROLOGUE == SWIGLU) {
        for (int base = threadIdx.x; base < chunks; base += 4 * blockDim.x) {
            uint4 g[4], u[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = base + j * blockDim.x;
                if (i < chunks) g[j] = xs[i], u[j] = xs[i + chunks];
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = base + j * blockDim.x;
                if (i >= chunks) continue;
                const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&g[j]);
                const __nv_bfloat162* up = reinterpret_cast<const __nv_bfloat162*>(&u[j]);
                __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(&staged[i]);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 a = __bfloat1622float2(gp[e]), b = __bfloat1622float2(up[e]);
                    out[e] = __floats2bfloat162_rn(silu(a.x) * b.x, silu(a.y) * b.y);
                }
            }
        }
        __syncthreads();
        return;
    }
    // GATED_NORM: each chunk's sum of squares, then each head's scale (summed in a fixed order: every replay rounds
    // alike), then the gated, normalised chunk in place of the raw one
    const uint4* gs = reinterpret_cast<const uint4*>(gate);
    uint4* gated = staged + chunks;  // (the gate's chunks, after x's)
    float* squares = scratch;
    float* scale = scratch + chunks;
    for (int base = threadIdx.x; base < chunks; base += 4 * blockDim.x) {
        uint4 r[4], g[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = base + j * blockDim.x;
            if (i < chunks) r[j] = xs[i], g[j] = gs[i];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = base + j * blockDim.x;
            if (i >= chunks) continue;
            const __nv_bfloat162* rp = reinterpret_cast<const __nv_bfloat162*>(&r[j]);
            float sum = 0.0f;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 v = __bfloat1622float2(rp[e]);
                sum = fmaf(v.x, v.x, fmaf(v.y, v.y, sum));
            }
            squares[i] = sum, staged[i] = r[j], gated[i] = g[j];
        }
    }
    __syncthreads();
    const int per_head = dim / 8;
    for (int h = threadIdx.x; h < k / dim; h += blockDim.x) {
        float sum = 0.0f;
        for (int i = 0; i < per_head; ++i) sum += squares[h * per_head + i];
        scale[h] = rsqrtf(sum / dim + eps);
    }
    __syncthreads();
    const uint4* ws = reinterpret_cast<const uint4*>(norm_weight);
    for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
        const uint4 wv = ws[i % per_head];
        const float s = scale[i / per_head];
        const __nv_bfloat162* rp = reinterpret_cast<const __nv_bfloat162*>(&staged[i]);
        const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&gated[i]);
        const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
        uint4 formed;
        __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(&formed);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 v = __bfloat1622float2(rp[e]), g = __bfloat1622float2(gp[e]), w = __bfloat1622float2(wp[e]);
            out[e] = __floats2bfloat162_rn(v.x * s * w.x * silu(g.x), v.y * s * w.y * silu(g.y));
        }
        staged[i] = formed;
    }
    __syncthreads();
}

template <int ROWS, int CHUNKS, bool STREAMING, bool PDL, int PROLOGUE>
__global__ void __launch_bounds__(256) gemv_kernel(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* x,
                                                   const __nv_bfloat16* gate, const __nv_bfloat16* norm_weight,
                                                   __nv_bfloat16* __restrict__ y, int n, int k, int dim, float eps,
                                                   unsigned int zero) {
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * ROWS;
    uint4 weights[ROWS][CHUNKS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = min(row0 + r, n - 1);  // (rows past N load the last row again; they are never stored)
        const uint4* src = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row) * k) + lane;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            weights[r][c] = load_weights<STREAMING>(src + 32 * c);
        }
    }
    // Every sum starts from the OR of all the loaded words times ``zero`` (a kernel argument that is 0): 0.0f, but the
    // assembler cannot know it, so it issues every weight load up front (left alone it sank each load to its first
    // use, a few in flight at a time) and, with PDL, cannot hoist the wait for the kernel before (x is its output)
    // above the loads either (waiting early is always correct, and slower here).
    unsigned int seen = 0;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) seen |= weights[r][c].x;
    if (PDL && 1 + static_cast<int>(seen & zero)) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // (the next kernel may start its loads)
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    float sums[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) sums[r] = __uint_as_float(seen & zero);
    // (coherent loads of x: the kernel just before may have written it)
    const uint4* xs = reinterpret_cast<const uint4*>(x) + lane;
    if (PROLOGUE != NONE) {
        extern __shared__ uint4 staged[];
        stage_x<PROLOGUE>(staged, reinterpret_cast<float*>(staged + (PROLOGUE == GATED_NORM ? 2 : 1) * (k / 8)), x, gate,
                          norm_weight, k, dim, eps);
        xs = staged + lane;
    }
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const uint4 chunk = xs[32 * c];
        const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&chunk);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&weights[r][c]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 wf = __bfloat1622float2(wp[i]);
                const float2 xf = __bfloat1622float2(xp[i]);
                sums[r] = fmaf(wf.x, xf.x, sums[r]);
                sums[r] = fmaf(wf.y, xf.y, sums[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float v = sums[r];
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
        if (lane == 0 && row0 + r < n) y[row0 + r] = __float2bfloat16(v);
    }
}

template <int ROWS, int CHUNKS, bool STREAMING, bool PDL, int PROLOGUE>
static int launch(const void* w, const void* x, const void* gate, const void* norm_weight, void* y, int n, int k,
                  int dim, float eps, int warps, cudaStream_t stream) {
    cudaLaunchConfig_t config = {};
    const int rows_per_block = ROWS * warps;
    config.gridDim = dim3((n + rows_per_block - 1) / rows_per_block);
    config.blockDim = dim3(32 * warps);
    config.stream = stream;
    // the prologue's shared memory: x (11 KB for down); the gated norm's gate, squares and head scales too (10 KB)
    config.dynamicSmemBytes = PROLOGUE == SWIGLU ? static_cast<size_t>(k) * 2
                              : PROLOGUE == GATED_NORM ? static_cast<size_t>(k) * 4 + (k / 8 + k / dim) * 4 : 0;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = PDL ? 1 : 0;
    using bf16 = __nv_bfloat16;
    return static_cast<int>(cudaLaunchKernelEx(&config, gemv_kernel<ROWS, CHUNKS, STREAMING, PDL, PROLOGUE>,
                                               static_cast<const bf16*>(w), static_cast<const bf16*>(x),
                                               static_cast<const bf16*>(gate), static_cast<const bf16*>(norm_weight),
                                               static_cast<bf16*>(y), n, k, dim, eps, 0u));
}

template <int R, int C, int PROLOGUE>
static int launch_as(int streaming, int pdl, const void* w, const void* x, const void* gate, const void* norm_weight,
                     void* y, int n, int k, int dim, float eps, int warps, cudaStream_t s) {
    if (pdl) return streaming ? launch<R, C, true, true, PROLOGUE>(w, x, gate, norm_weight, y, n, k, dim, eps, warps, s)
                              : launch<R, C, false, true, PROLOGUE>(w, x, gate, norm_weight, y, n, k, dim, eps, warps, s);
    return streaming ? launch<R, C, true, false, PROLOGUE>(w, x, gate, norm_weight, y, n, k, dim, eps, warps, s)
                     : launch<R, C, false, false, PROLOGUE>(w, x, gate, norm_weight, y, n, k, dim, eps, warps, s);
}

#define SPECLA_GEMV_CASE(R, C)                                                                                  \
    if (rows == R && chunks == C) {                                                                             \
        const cudaStream_t s = static_cast<cudaStream_t>(stream);                                               \
        if (prologue == SWIGLU)                                                                                 \
            return launch_as<R, C, SWIGLU>(streaming, pdl, w, x, gate, norm_weight, y, n, k, dim, eps, warps, s); \
        if (prologue == GATED_NORM)                                                                             \
            return launch_as<R, C, GATED_NORM>(streaming, pdl, w, x, gate, norm_weight, y, n, k, dim, eps, warps, s); \
        return launch_as<R, C, NONE>(streaming, pdl, w, x, gate, norm_weight, y, n, k, dim, eps, warps, s);      \
    }

// 0 on success, a cudaError_t, or -1 for a shape or configuration without an instance here: K a multiple of 256
// (K / 256 in {4, 8, 16, 22}: depths 1024, 2048, 4096 and 5632), ROWS * K / 256 <= 32 (128 registers of weights),
// warps in [1, 8], a prologue in {0, 1, 2}; the gated norm's head size D a multiple of 8 dividing K. swiglu: x holds
// [gate, up], 2K wide; gated norm: x and gate hold K values, norm_weight D.
extern "C" int specla_gemv(const void* w, const void* x, const void* gate, const void* norm_weight, void* y, int n,
                           int k, int rows, int warps, int streaming, int pdl, int prologue, int dim, float eps,
                           void* stream) {
    if (k % 256 != 0 || warps < 1 || warps > 8 || n < 1 || prologue < NONE || prologue > GATED_NORM) return -1;
    if (prologue == GATED_NORM && (dim < 8 || dim % 8 != 0 || k % dim != 0)) return -1;
    const int chunks = k / 256;
    SPECLA_GEMV_CASE(1, 4) SPECLA_GEMV_CASE(2, 4) SPECLA_GEMV_CASE(4, 4) SPECLA_GEMV_CASE(8, 4)
    SPECLA_GEMV_CASE(1, 8) SPECLA_GEMV_CASE(2, 8) SPECLA_GEMV_CASE(4, 8)
    SPECLA_GEMV_CASE(1, 16) SPECLA_GEMV_CASE(2, 16)
    SPECLA_GEMV_CASE(1, 22)
    return -1;
}
