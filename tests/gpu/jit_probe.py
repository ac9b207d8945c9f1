"""How long the driver takes to turn each shipped PTX module into machine code (its JIT), one
module at a time and all at once from one thread per module, through libcuda alone (ctypes,
cuModuleLoadData with no options: what cudarc's load_module does, so the driver's compute cache
entries are the ones the binary would hit).
Usage: jit_probe.py PTX_DIR [seq|par|both]
Run under CUDA_CACHE_DISABLE=1 for the JIT itself; without it a second run shows a cache hit."""
import ctypes, os, sys, threading, time

ptx_dir = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "both"
cu = ctypes.CDLL("libcuda.so.1")


def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what}: CUresult {rc}")


check(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
files = sorted(f for f in os.listdir(ptx_dir) if f.endswith(".ptx"))
srcs = {f: open(os.path.join(ptx_dir, f), "rb").read() + b"\0" for f in files}


def load(f, out):
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    m = ctypes.c_void_p()
    t0 = time.time()
    check(cu.cuModuleLoadData(ctypes.byref(m), ctypes.c_char_p(srcs[f])), f"cuModuleLoadData {f}")
    out[f] = time.time() - t0
    cu.cuModuleUnload(m)


print(f"CUDA_CACHE_DISABLE={os.environ.get('CUDA_CACHE_DISABLE', '')} modules {len(files)}", flush=True)
if mode in ("seq", "both"):
    t, t0 = {}, time.time()
    for f in files:
        load(f, t)
    for f in files:
        print(f"  seq {f:20s} {len(srcs[f]) / 1e6:6.2f} MB {t[f]:7.2f} s", flush=True)
    print(f"sequential total {time.time() - t0:.2f} s", flush=True)
if mode in ("par", "both"):
    t, t0 = {}, time.time()
    th = [threading.Thread(target=load, args=(f, t)) for f in files]
    for x in th:
        x.start()
    for x in th:
        x.join()
    print(f"parallel (one thread per module) wall {time.time() - t0:.2f} s; longest "
          f"{max(t, key=t.get)} {max(t.values()):.2f} s", flush=True)
