"""The CPU a benchmark ran on, for its report: the model name and the SIMD flags that matter;
and the median timer the scripts share."""

import re
import statistics
import time


def cpu_flags():
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "?"
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = sorted(set(re.findall(r"\b(avx512\w*|avx2|amx\w*)\b", text)))
    return f"{model.group(1) if model else '?'}; {' '.join(flags)}"


def median_time(fn, reps):
    """Median seconds of `reps` calls of fn, after one call to warm up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
