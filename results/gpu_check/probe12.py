"""Run 12: the device container's CPU limits, and a pure-Python loop and transposes timed idle and while copies stream."""
import time, threading, torch, os
print("nproc", os.cpu_count(), "affinity", len(os.sched_getaffinity(0)))
for f in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"):
    try: print(f, open(f).read().strip().replace("\n", "; "))
    except Exception as e: print(f, "n/a")
def spin(n=200000):
    t = time.perf_counter(); x = 0
    for i in range(n): x += i
    return time.perf_counter() - t
def views(n=20000):
    a = torch.empty(64, 64, device="cuda"); t = time.perf_counter()
    for _ in range(n): a.view(4096).t if False else a.transpose(0, 1)
    return time.perf_counter() - t
print("idle: spin", round(spin(), 4), "transpose", round(views(), 4))
d = torch.randn(64 << 20, device="cuda"); h = torch.empty(64 << 20, pin_memory=True); s = torch.cuda.Stream()
stop = False
def copies():
    with torch.cuda.stream(s):
        while not stop:
            h.copy_(d, non_blocking=True); d.copy_(h, non_blocking=True); s.synchronize()
th = threading.Thread(target=copies); th.start(); time.sleep(0.2)
print("copies streaming: spin", round(spin(), 4), "transpose", round(views(), 4))
stop = True; th.join()
for f in ("/sys/fs/cgroup/cpu.stat",):
    try: print(f, open(f).read().strip().replace("\n", "; "))
    except Exception: pass
