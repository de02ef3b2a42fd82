"""The CPU a benchmark ran on, for its report: the model name and the SIMD flags that matter."""

import re


def cpu_flags():
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "?"
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = sorted(set(re.findall(r"\b(avx512\w*|avx2|amx\w*)\b", text)))
    return f"{model.group(1) if model else '?'}; {' '.join(flags)}"
