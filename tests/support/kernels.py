"""Kernels the tests share: C for the cpu device, and the same in the Metal Shading
Language subset the simulated compiler accepts."""

# Kernels used across the tests: C for the cpu device.
KERNELS = r"""
void empty(void) {}
void add(float* out, const float* a, const float* b, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + b[i];
}
void fill(int* out, int value, int n) { for (int i = 0; i < n; i++) out[i] = value; }
/* out[dst] = out[dst] * 31 + out[src] + val: order-sensitive, so a race shows */
void step(int* cells, int dst, int src, int val) {
    cells[dst] = cells[dst] * 31 + cells[src] + val;
}
void spin(int* out, int iters) {
    volatile int x = 0;
    for (int i = 0; i < iters; i++) x += i;
    out[0] += 1;
}
#include <time.h>
void sleep_ms(int ms) {
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    nanosleep(&ts, 0);
}
"""


# The same kernels in the Metal Shading Language subset the simulated compiler accepts:
# one thread does what the C function does (launches use one thread by default).
MSL_KERNELS = r"""
#include <metal_stdlib>
using namespace metal;
kernel void empty(uint i [[thread_position_in_grid]]) {}
kernel void add(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                const device float* b [[buffer(2)]], constant int& n [[buffer(3)]],
                uint i [[thread_position_in_grid]]) {
    if (i == 0) for (int j = 0; j < n; j++) out[j] = a[j] + b[j];
}
kernel void fill(device int* out [[buffer(0)]], constant int& value [[buffer(1)]],
                 constant int& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    if (i == 0) for (int j = 0; j < n; j++) out[j] = value;
}
kernel void step(device int* cells [[buffer(0)]], constant int& dst [[buffer(1)]],
                 constant int& src [[buffer(2)]], constant int& val [[buffer(3)]],
                 uint i [[thread_position_in_grid]]) {
    if (i == 0) cells[dst] = cells[dst] * 31 + cells[src] + val;
}
kernel void spin(device int* out [[buffer(0)]], constant int& iters [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
    volatile int x = 0;
    for (int k = 0; k < iters; k++) x += k;
    if (i == 0) out[0] += 1;
}
// MSL cannot sleep. The simulation sleeps `ms` milliseconds (its hook); a real GPU runs a
// busy loop, as long as the GPU makes it: no test may count on its length there.
kernel void sleep_ms(constant int& ms [[buffer(0)]], uint i [[thread_position_in_grid]]) {
#ifdef __ASYNCMETAL_SIM__
    if (i == 0) __asyncmetal_sim_sleep_ms(ms);
#else
    volatile int x = 0;
    for (long k = 0; k < (long)ms * 400000; k++) x += 1;
#endif
}
"""
