// A one-row GEMV in CUDA C: y[n] = W[n, :] . x, bf16 in and out, fp32 sums (kernels/cuda_gemv.py builds and calls
// it: specla::row_gemv's CUDA kernel, and benchmarks/gemv_cuda_gpu.py's subject). SWIGLU: x is silu(gate) * up of a
// packed [gate, up] row of 2K (an MLP's down projection), each product rounded to bf16 as inductor's kernel writes it,
// formed once per block into shared memory after the wait (formed per warp, an H200 pass took 0.24 ms longer).
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

// silu(gate) * up of 8 packed pairs, each product in fp32 rounded to bf16.
__device__ __forceinline__ uint4 swiglu_chunk(const uint4 gate_chunk, const uint4 up_chunk) {
    const __nv_bfloat162* gate = reinterpret_cast<const __nv_bfloat162*>(&gate_chunk);
    const __nv_bfloat162* up = reinterpret_cast<const __nv_bfloat162*>(&up_chunk);
    uint4 out;
    __nv_bfloat162* product = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 g = __bfloat1622float2(gate[i]);
        const float2 u = __bfloat1622float2(up[i]);
        product[i] = __floats2bfloat162_rn(g.x / (1.0f + __expf(-g.x)) * u.x, g.y / (1.0f + __expf(-g.y)) * u.y);
    }
    return out;
}

template <int ROWS, int CHUNKS, bool STREAMING, bool PDL, bool SWIGLU>
__global__ void __launch_bounds__(256) gemv_kernel(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* x,
                                                   __nv_bfloat16* __restrict__ y, int n, int k, unsigned int zero) {
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
    if (SWIGLU) {  // the block forms the row's products once, in shared memory (per warp: 8 times the exponentials)
        extern __shared__ uint4 staged[];
        const uint4* packed = reinterpret_cast<const uint4*>(x);
        for (int base = threadIdx.x; base < k / 8; base += 4 * blockDim.x) {  // (4 pairs' loads in flight at once)
            uint4 gate[4], up[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = base + j * blockDim.x;
                if (i < k / 8) gate[j] = packed[i], up[j] = packed[i + k / 8];
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = base + j * blockDim.x;
                if (i < k / 8) staged[i] = swiglu_chunk(gate[j], up[j]);
            }
        }
        __syncthreads();
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

template <int ROWS, int CHUNKS, bool STREAMING, bool PDL, bool SWIGLU>
static int launch(const void* w, const void* x, void* y, int n, int k, int warps, cudaStream_t stream) {
    cudaLaunchConfig_t config = {};
    const int rows_per_block = ROWS * warps;
    config.gridDim = dim3((n + rows_per_block - 1) / rows_per_block);
    config.blockDim = dim3(32 * warps);
    config.stream = stream;
    config.dynamicSmemBytes = SWIGLU ? static_cast<size_t>(k) * 2 : 0;  // (the row's products: 11 KB for down)
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = PDL ? 1 : 0;
    return static_cast<int>(cudaLaunchKernelEx(&config, gemv_kernel<ROWS, CHUNKS, STREAMING, PDL, SWIGLU>,
                                               static_cast<const __nv_bfloat16*>(w), static_cast<const __nv_bfloat16*>(x),
                                               static_cast<__nv_bfloat16*>(y), n, k, 0u));
}

#define SPECLA_GEMV_CASE(R, C)                                                                                  \
    if (rows == R && chunks == C) {                                                                             \
        const cudaStream_t s = static_cast<cudaStream_t>(stream);                                               \
        switch ((streaming ? 1 : 0) | (pdl ? 2 : 0) | (swiglu ? 4 : 0)) {                                       \
            case 0: return launch<R, C, false, false, false>(w, x, y, n, k, warps, s);                           \
            case 1: return launch<R, C, true, false, false>(w, x, y, n, k, warps, s);                            \
            case 2: return launch<R, C, false, true, false>(w, x, y, n, k, warps, s);                            \
            case 3: return launch<R, C, true, true, false>(w, x, y, n, k, warps, s);                             \
            case 4: return launch<R, C, false, false, true>(w, x, y, n, k, warps, s);                            \
            case 5: return launch<R, C, true, false, true>(w, x, y, n, k, warps, s);                             \
            case 6: return launch<R, C, false, true, true>(w, x, y, n, k, warps, s);                             \
            default: return launch<R, C, true, true, true>(w, x, y, n, k, warps, s);                             \
        }                                                                                                       \
    }

// 0 on success, a cudaError_t, or -1 for a shape or configuration without an instance here: K a multiple of 256
// (K / 256 in {4, 8, 16, 22}: depths 1024, 2048, 4096 and 5632), ROWS * K / 256 <= 32 (128 registers of weights),
// warps in [1, 8]. swiglu: x holds [gate, up], 2K wide.
extern "C" int specla_gemv(const void* w, const void* x, void* y, int n, int k, int rows, int warps, int streaming,
                           int pdl, int swiglu, void* stream) {
    if (k % 256 != 0 || warps < 1 || warps > 8 || n < 1) return -1;
    const int chunks = k / 256;
    SPECLA_GEMV_CASE(1, 4) SPECLA_GEMV_CASE(2, 4) SPECLA_GEMV_CASE(4, 4) SPECLA_GEMV_CASE(8, 4)
    SPECLA_GEMV_CASE(1, 8) SPECLA_GEMV_CASE(2, 8) SPECLA_GEMV_CASE(4, 8)
    SPECLA_GEMV_CASE(1, 16) SPECLA_GEMV_CASE(2, 16)
    SPECLA_GEMV_CASE(1, 22)
    return -1;
}
