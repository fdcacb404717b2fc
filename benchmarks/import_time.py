"""What `import kvq_ao` costs: fresh interpreters, median wall time of each import statement.

    python benchmarks/import_time.py [--repeats 7]

`import kvq_ao` loads nothing heavy (every public name is resolved on first use), so it should
cost no more than `import torch`; the first real use (`from kvq_ao import quantize_kv_,
KVQuantConfig`) then pays for torch, torchao and transformers. Rows in results/import_time/import_time.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from common import save_json, stamp

STATEMENTS = {
    "python": "pass",
    "import torch": "import torch",
    "import kvq_ao": "import kvq_ao",
    "import transformers": "import transformers",
    "from kvq_ao import quantize_kv_, KVQuantConfig": "from kvq_ao import quantize_kv_, KVQuantConfig",
}


def wall_time(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="results/import_time/import_time.json")
    args = parser.parse_args()
    for code in STATEMENTS.values():  # warm the OS file cache once
        wall_time(code)
    rows = []
    for label, code in STATEMENTS.items():
        times = [wall_time(code) for _ in range(args.repeats)]
        rows.append(dict(statement=label, median_s=round(statistics.median(times), 3), min_s=round(min(times), 3),
                         max_s=round(max(times), 3)))  # fmt: skip
        print(f"{label:50} median {rows[-1]['median_s']:.2f} s (min {rows[-1]['min_s']:.2f}, max {rows[-1]['max_s']:.2f})", flush=True)
    torch_s = next(r["median_s"] for r in rows if r["statement"] == "import torch")
    kvq_s = next(r["median_s"] for r in rows if r["statement"] == "import kvq_ao")
    print(f"import kvq_ao - import torch = {kvq_s - torch_s:+.2f} s (target: at most +1 s)")
    save_json(args.out, stamp(repeats=args.repeats, python=sys.version.split()[0], rows=rows))


if __name__ == "__main__":
    main()
