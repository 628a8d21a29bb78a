"""A bf16 matmul loop on one core: `python mm2.py CORE SECONDS`; each sample 5 products of
(2048x512)(512x2048); prints the median and a line per 100 samples, # for a sample > 1.3x
the median."""
import os
import statistics
import sys
import time

import torch

os.sched_setaffinity(0, {int(sys.argv[1])})
torch.set_num_threads(1)
a = torch.randn(2048, 512, dtype=torch.bfloat16)
b = torch.randn(512, 2048, dtype=torch.bfloat16)
for _ in range(3):
    a @ b
t0 = time.perf_counter()
ms = []
while time.perf_counter() - t0 < float(sys.argv[2]):
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    ms.append((time.perf_counter() - t) * 1000)
s = sorted(ms)
print(f"n {len(ms)} median {statistics.median(ms):.1f} p10 {s[len(s) // 10]:.1f} "
      f"p90 {s[9 * len(s) // 10]:.1f}")
slow = [m > statistics.median(ms) * 1.3 for m in ms]
after = sum(1 for i in range(1, len(slow)) if slow[i] and slow[i - 1])
print(f"slow frac {sum(slow) / len(slow):.2f}, "
      f"P(slow|prev slow) {after / max(1, sum(slow[:-1])):.2f}")
line = "".join("#" if x else "." for x in slow)
for i in range(0, min(len(line), 600), 100):
    print(line[i:i + 100])
