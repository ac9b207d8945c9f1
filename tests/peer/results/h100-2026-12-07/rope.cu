// cos/sin tables (bf16 bits) for positions [0, n) and freq index i < half, two ways:
// v0 = the kernel's current formula (powf / cosf / sinf in f32), v1 = inv_freq from the host
// (passed in) and cos/sin in double rounded to f32. Output: raw uint16 [2 variants][cos,sin][n][half].
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <vector>
#include <cuda_runtime.h>
__device__ uint16_t f2bf(float f) { uint32_t u = __float_as_uint(f); u += 0x7fff + ((u >> 16) & 1); return (uint16_t)(u >> 16); }
__global__ void k(int n, int half, float theta, int rot, const float *invh, uint16_t *out) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x; if (idx >= n * half) return;
    int pos = idx / half, fi = idx % half;
    size_t plane = (size_t)n * half;
    float inv0 = 1.f / powf(theta, (float)(2 * fi) / (float)rot);
    float f0 = (float)pos * inv0;
    out[idx] = f2bf(cosf(f0)); out[plane + idx] = f2bf(sinf(f0));
    float f1 = (float)pos * invh[fi];
    out[2 * plane + idx] = f2bf((float)cos((double)f1)); out[3 * plane + idx] = f2bf((float)sin((double)f1));
    out[4 * plane + idx] = f2bf(cosf(f1)); out[5 * plane + idx] = f2bf(sinf(f1));
    if (pos == 0) { ((float*)(out + 6 * plane))[fi] = inv0; }
}
int main(int argc, char **argv) {
    int n = atoi(argv[1]), rot = 64, half = 32; float theta = 1e7f;
    std::vector<float> inv(half); FILE *fi = fopen(argv[2], "rb"); fread(inv.data(), 4, half, fi); fclose(fi);
    float *dinv; uint16_t *dout; size_t plane = (size_t)n * half, bytes = 6 * plane * 2 + half * 4;
    cudaMalloc(&dinv, half * 4); cudaMalloc(&dout, bytes);
    cudaMemcpy(dinv, inv.data(), half * 4, cudaMemcpyHostToDevice);
    k<<<(n * half + 255) / 256, 256>>>(n, half, theta, rot, dinv, dout);
    std::vector<uint8_t> h(bytes); cudaMemcpy(h.data(), dout, bytes, cudaMemcpyDeviceToHost);
    FILE *fo = fopen(argv[3], "wb"); fwrite(h.data(), 1, bytes, fo); fclose(fo);
    printf("cuda err %s\n", cudaGetErrorString(cudaGetLastError()));
}
