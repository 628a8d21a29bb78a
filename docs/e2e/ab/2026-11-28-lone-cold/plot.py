"""The plot of this A/B: every lone cold prompt's 2,048-token prefill step by wall-clock time,
per arm (.venv/bin/python plot.py; reads steps/<tag>/steps-*.txt, writes steps.png)."""
import datetime
import glob
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the checkout
from worker.step_log import read

HERE = Path(__file__).parent
# step logs are on the monotonic clock: wall = monotonic + this run's offset (written below)
OFFSET = float((HERE / "clock_offset.txt").read_text())
ARMS = {"kv_centric": ("ours, make run's shape", "tab:blue"),
        "kv_tcp": ("ours, pool over TCP (KV cache in vLLM's memory)", "tab:green"),
        "serve1": ("vllm serve, one thread, no connector", "tab:orange")}
TAGS = {"a": "kv_centric", "b": "serve1"}
fig, ax = plt.subplots(figsize=(9, 4.2))
seen = set()
for d in sorted(glob.glob(str(HERE / "steps" / "*"))):
    tag = Path(d).name
    arm = TAGS.get(tag, tag.rsplit("_", 1)[0])
    big = [s for s in read(d) if s.tokens == 2048]
    xs = [datetime.datetime.utcfromtimestamp(s.start + OFFSET) for s in big]
    ys = [s.ms for s in big]
    label, color = ARMS[arm]
    ax.scatter(xs, ys, s=14, color=color, label=None if arm in seen else label)
    seen.add(arm)
ax.set_ylabel("2,048-token prefill step (ms)")
ax.set_xlabel("UTC, 2026-11-28")
ax.set_ylim(0, None)
ax.xaxis.set_major_formatter(matplotlib.dates.DateFormatter("%H:%M"))
ax.set_title("Lone cold 2,250-token prompts, one at a time: the same step, minutes apart")
ax.legend(loc="lower right", fontsize=8)
fig.tight_layout()
fig.savefig(HERE / "steps.png", dpi=110)
print("wrote", HERE / "steps.png", time.strftime("%H:%M"))
