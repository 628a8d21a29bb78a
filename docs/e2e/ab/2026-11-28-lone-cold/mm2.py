"""A bf16 matmul loop on one core: `python mm2.py CORE SECONDS`; each sample 5 products of
(2048x512)(512x2048); prints the median and a line per 100 samples, # for a sample > 1.3x
the median."""
import os
import sys
import time

import torch

os.sched_setaffinity(0, {int(sys.argv[1])})
torch.set_num_threads(1)
a = torch.randn(2048, 512, dtype=torch.bfloat16); b = torch.randn(512, 2048, dtype=torch.bfloat16)
for _ in range(3): a @ b
t0 = time.perf_counter(); out = []
while time.perf_counter() - t0 < float(sys.argv[2]):
    t = time.perf_counter()
    for _ in range(5): a @ b
    out.append((t - t0, (time.perf_counter() - t) * 1000))
import statistics

ms = [m for _, m in out]
print("n", len(ms), "median %.1f p10 %.1f p90 %.1f" % (statistics.median(ms), sorted(ms)[len(ms)//10], sorted(ms)[9*len(ms)//10]))
# runs: fraction of consecutive pairs both slow (> median*1.3)
thr = statistics.median(ms) * 1.3
slow = [m > thr for m in ms]
print("slow frac %.2f, P(slow|prev slow) %.2f" % (sum(slow)/len(slow), sum(1 for i in range(1,len(slow)) if slow[i] and slow[i-1]) / max(1, sum(slow[:-1]))))
line = "".join("#" if s else "." for s in slow)
for i in range(0, min(len(line), 600), 100): print(line[i:i+100])
