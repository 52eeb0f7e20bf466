// A stub libcuda.so.1 for measuring host-side cost without a GPU (experiments/replay_host_cost.py):
// every entry point deviceop's native module and cuda.bindings call for a graph replay returns
// success at once. Not a driver: nothing runs.
//
// Build:  cc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 stub_cuda.c -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

int cuInit(unsigned flags) { return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuLaunchKernel(void) { return 0; }
int cuLaunchHostFunc(void) { return 0; }
int cuGraphLaunch(void *exec, void *stream) { return 0; }
int cuEventRecord(void) { return 0; }
int cuEventQuery(void) { return 0; }
int cuStreamSynchronize(void *stream) { return 0; }

static void *current = (void *)1;
int cuCtxGetCurrent(void **ctx) { *ctx = current; return 0; }
int cuCtxSetCurrent(void *ctx) { current = ctx; return 0; }

// cuda.bindings resolves its entry points through cuGetProcAddress: hand out this library's
int cuGetProcAddress_v2(const char *sym, void **pfn, int version, unsigned long long flags, int *status) {
    char name[256];
    void *p = dlsym(RTLD_DEFAULT, sym);
    if (p == NULL) {
        snprintf(name, sizeof name, "%s_v2", sym);
        p = dlsym(RTLD_DEFAULT, name);
    }
    *pfn = p;
    if (status != NULL) *status = p != NULL ? 0 : 1;
    return p != NULL ? 0 : 500;  // CUDA_ERROR_NOT_FOUND
}

int cuGetProcAddress(const char *sym, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(sym, pfn, version, flags, NULL);
}
