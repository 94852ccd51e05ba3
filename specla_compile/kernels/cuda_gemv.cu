// A one-row GEMV in CUDA C: y[n] = W[n, :] . x, bf16 in and out, fp32 sums (kernels/cuda_gemv.py builds and calls
// it: specla::row_gemv's CUDA kernel, and benchmarks/gemv_cuda_gpu.py's subject). A prologue may form x first, once per
// block into shared memory after the wait (formed per warp, an H200 pass took 0.24 ms longer), each value in fp32
// rounded once to bf16 as the op's reference rounds it:
//   SWIGLU      x = silu(gate) * up of a packed [gate, up] row of 2K (an MLP's down projection);
//   GATED_NORM  x = r * rsqrt(mean(r^2 over its head) + eps) * norm_weight * silu(g) of a row r of K / D heads of D
//               values and its gate g (fla's gated output norm; o_proj);
//   ADD_NORM    x = h * rsqrt(mean(h^2) + eps) * norm_weight of h = r + s, a residual add and the RMS norm after it
//               (the GEMM after a decoder block's norm), h summed in fp32 (fla's fused prenorm) or rounded to bf16
//               first (an add, then the norm); block 0 also writes h rounded to bf16, the residual stream after it.
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

enum Prologue { NONE = 0, SWIGLU = 1, GATED_NORM = 2, ADD_NORM = 3 };

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// What a prologue reads besides x, and ADD_NORM's output h (unused fields: null or 0).
struct PrologueArgs {
    const __nv_bfloat16* gate;  // GATED_NORM's gate, ADD_NORM's skip: K values
    const __nv_bfloat16* norm_weight;  // D values (ADD_NORM: D = K)
    __nv_bfloat16* sum_out;  // ADD_NORM: r + s rounded, K values
    int dim;
    float eps;
    int round_sum;
};

// The value a norm prologue normalises, from the row's pair ``a`` (r) and ``b`` (the gate, or the skip): GATED_NORM r;
// ADD_NORM r + s in fp32, or rounded to bf16 as a separate add would have stored it (round_sum).
template <int PROLOGUE>
__device__ __forceinline__ float2 norm_input(__nv_bfloat162 a, __nv_bfloat162 b, int round_sum) {
    const float2 r = __bfloat1622float2(a);
    if (PROLOGUE != ADD_NORM) return r;
    const float2 s = __bfloat1622float2(b);
    const float2 h = make_float2(r.x + s.x, r.y + s.y);
    return round_sum ? __bfloat1622float2(__floats2bfloat162_rn(h.x, h.y)) : h;
}

// Chunks base + j * blockDim.x (j < 4, those below ``chunks``) of two arrays of 16-byte chunks into registers, their
// loads in flight together.
__device__ __forceinline__ void load_four(const uint4* a, const uint4* b, int base, int chunks, uint4 (&ra)[4],
                                          uint4 (&rb)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = base + j * blockDim.x;
        if (i < chunks) ra[j] = a[i], rb[j] = b[i];
    }
}

// The block's x into ``staged`` (K / 8 chunks of 16 bytes), formed by PROLOGUE from ``x`` (and ``gate``,
// ``norm_weight``); ``scratch`` holds K / 8 + K / D floats. Each thread handles chunks threadIdx.x + j * blockDim.x,
// four at a time so that their loads are in flight together.
template <int PROLOGUE>
__device__ __forceinline__ void stage_x(uint4* staged, float* scratch, const __nv_bfloat16* x, const PrologueArgs& p,
                                        int k) {
    const int chunks = k / 8, dim = p.dim, round_sum = p.round_sum;
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    if (PROLOGUE == SWIGLU) {
        for (int base = threadIdx.x; base < chunks; base += 4 * blockDim.x) {
            uint4 g[4], u[4];
            load_four(xs, xs + chunks, base, chunks, g, u);
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
    // GATED_NORM and ADD_NORM: each chunk's sum of squares of what the norm reads, then each head's scale (a warp a
    // head, in a fixed order: every replay rounds alike; ADD_NORM's one head is the row), then the normalised chunk
    // (gated for GATED_NORM) in place of the raw one
    const uint4* gs = reinterpret_cast<const uint4*>(p.gate);
    uint4* paired = staged + chunks;  // (the gate's or skip's chunks, after x's)
    float* squares = scratch;
    float* scale = scratch + chunks;
    for (int base = threadIdx.x; base < chunks; base += 4 * blockDim.x) {
        uint4 r[4], g[4];
        load_four(xs, gs, base, chunks, r, g);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = base + j * blockDim.x;
            if (i >= chunks) continue;
            const __nv_bfloat162* rp = reinterpret_cast<const __nv_bfloat162*>(&r[j]);
            const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&g[j]);
            float sum = 0.0f;
            uint4 summed;
            __nv_bfloat162* sp = reinterpret_cast<__nv_bfloat162*>(&summed);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 v = norm_input<PROLOGUE>(rp[e], gp[e], round_sum);
                sum = fmaf(v.x, v.x, fmaf(v.y, v.y, sum));
                if (PROLOGUE == ADD_NORM) sp[e] = __floats2bfloat162_rn(v.x, v.y);  // (h, rounded or not: rounds alike)
            }
            squares[i] = sum, staged[i] = r[j], paired[i] = g[j];
            if (PROLOGUE == ADD_NORM && blockIdx.x == 0) reinterpret_cast<uint4*>(p.sum_out)[i] = summed;
        }
    }
    __syncthreads();
    const int per_head = dim / 8, lane = threadIdx.x & 31;
    for (int h = threadIdx.x >> 5; h < k / dim; h += blockDim.x >> 5) {
        float sum = 0.0f;
        for (int i = lane; i < per_head; i += 32) sum += squares[h * per_head + i];
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        if (lane == 0) scale[h] = rsqrtf(sum / dim + p.eps);
    }
    __syncthreads();
    const uint4* ws = reinterpret_cast<const uint4*>(p.norm_weight);
    for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
        const uint4 wv = ws[i % per_head];
        const float s = scale[i / per_head];
        const __nv_bfloat162* rp = reinterpret_cast<const __nv_bfloat162*>(&staged[i]);
        const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&paired[i]);
        const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
        uint4 formed;
        __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(&formed);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 v = norm_input<PROLOGUE>(rp[e], gp[e], round_sum), w = __bfloat1622float2(wp[e]);
            if (PROLOGUE == GATED_NORM) {
                const float2 g = __bfloat1622float2(gp[e]);
                out[e] = __floats2bfloat162_rn(v.x * s * w.x * silu(g.x), v.y * s * w.y * silu(g.y));
            } else {
                out[e] = __floats2bfloat162_rn(v.x * s * w.x, v.y * s * w.y);
            }
        }
        staged[i] = formed;
    }
    __syncthreads();
}

template <int ROWS, int CHUNKS, bool STREAMING, bool PDL, int PROLOGUE>
__global__ void __launch_bounds__(256) gemv_kernel(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* x,
                                                   __nv_bfloat16* __restrict__ y, int n, int k, PrologueArgs p,
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
        stage_x<PROLOGUE>(staged, reinterpret_cast<float*>(staged + (PROLOGUE == SWIGLU ? 1 : 2) * (k / 8)), x, p, k);
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
static int launch(const void* w, const void* x, void* y, int n, int k, const PrologueArgs& p, int warps,
                  cudaStream_t stream) {
    cudaLaunchConfig_t config = {};
    const int rows_per_block = ROWS * warps;
    config.gridDim = dim3((n + rows_per_block - 1) / rows_per_block);
    config.blockDim = dim3(32 * warps);
    config.stream = stream;
    // the prologue's shared memory: x (11 KB for down); the norms' second input, squares and head scales too (10 KB)
    config.dynamicSmemBytes = PROLOGUE == SWIGLU ? static_cast<size_t>(k) * 2
                              : PROLOGUE != NONE ? static_cast<size_t>(k) * 4 + (k / 8 + k / p.dim) * 4 : 0;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = PDL ? 1 : 0;
    using bf16 = __nv_bfloat16;
    return static_cast<int>(cudaLaunchKernelEx(&config, gemv_kernel<ROWS, CHUNKS, STREAMING, PDL, PROLOGUE>,
                                               static_cast<const bf16*>(w), static_cast<const bf16*>(x),
                                               static_cast<bf16*>(y), n, k, p, 0u));
}

template <int R, int C, int PROLOGUE>
static int launch_as(int streaming, int pdl, const void* w, const void* x, void* y, int n, int k, const PrologueArgs& p,
                     int warps, cudaStream_t s) {
    if (pdl) return streaming ? launch<R, C, true, true, PROLOGUE>(w, x, y, n, k, p, warps, s)
                              : launch<R, C, false, true, PROLOGUE>(w, x, y, n, k, p, warps, s);
    return streaming ? launch<R, C, true, false, PROLOGUE>(w, x, y, n, k, p, warps, s)
                     : launch<R, C, false, false, PROLOGUE>(w, x, y, n, k, p, warps, s);
}

#define SPECLA_GEMV_CASE(R, C)                                                                                 \
    if (rows == R && chunks == C) {                                                                            \
        const cudaStream_t s = static_cast<cudaStream_t>(stream);                                              \
        if (prologue == SWIGLU) return launch_as<R, C, SWIGLU>(streaming, pdl, w, x, y, n, k, p, warps, s);         \
        if (prologue == GATED_NORM) return launch_as<R, C, GATED_NORM>(streaming, pdl, w, x, y, n, k, p, warps, s); \
        if (prologue == ADD_NORM) return launch_as<R, C, ADD_NORM>(streaming, pdl, w, x, y, n, k, p, warps, s);     \
        return launch_as<R, C, NONE>(streaming, pdl, w, x, y, n, k, p, warps, s);                                   \
    }

// 0 on success, a cudaError_t, or -1 for a shape or configuration without an instance here: K a multiple of 256
// (K / 256 in {4, 8, 16, 22}: depths 1024, 2048, 4096 and 5632), ROWS * K / 256 <= 32 (128 registers of weights),
// warps in [1, 8], a prologue in {0, 1, 2, 3}; the gated norm's head size D a multiple of 8 dividing K. swiglu: x
// holds [gate, up], 2K wide; gated norm: x and gate hold K values, norm_weight D; add norm: x, gate (the skip),
// norm_weight and sum_out K values each (dim is K), round_sum 0 or 1.
extern "C" int specla_gemv(const void* w, const void* x, const void* gate, const void* norm_weight, void* sum_out,
                           void* y, int n, int k, int rows, int warps, int streaming, int pdl, int prologue, int dim,
                           float eps, int round_sum, void* stream) {
    if (k % 256 != 0 || warps < 1 || warps > 8 || n < 1 || prologue < NONE || prologue > ADD_NORM) return -1;
    if (prologue == GATED_NORM && (dim < 8 || dim % 8 != 0 || k % dim != 0)) return -1;
    if (prologue == ADD_NORM && (dim != k || sum_out == nullptr)) return -1;
    const PrologueArgs p = {static_cast<const __nv_bfloat16*>(gate), static_cast<const __nv_bfloat16*>(norm_weight),
                            static_cast<__nv_bfloat16*>(sum_out), prologue == SWIGLU || prologue == NONE ? 1 : dim,
                            eps, round_sum};
    const int chunks = k / 256;
    SPECLA_GEMV_CASE(1, 4) SPECLA_GEMV_CASE(2, 4) SPECLA_GEMV_CASE(4, 4) SPECLA_GEMV_CASE(8, 4)
    SPECLA_GEMV_CASE(1, 8) SPECLA_GEMV_CASE(2, 8) SPECLA_GEMV_CASE(4, 8)
    SPECLA_GEMV_CASE(1, 16) SPECLA_GEMV_CASE(2, 16)
    SPECLA_GEMV_CASE(1, 22)
    return -1;
}
