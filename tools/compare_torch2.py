#!/usr/bin/env python3
# compare_torch2.py: memanat's predicted peak allocated against the torch2 ground-truth table.
#
# For each row of test/validation/torch2.tsv it runs `./memanat estimate <args> --json` and
# prints measured and predicted peak allocated bytes with the relative error, then the median and
# worst absolute error. The measurement cannot see the cuBLAS workspace (allocated through the
# caching allocator on a real GPU, so inside max_memory_allocated), so the error is taken
# against the prediction less its "workspace" term; the prediction with it is printed too.
# Never fails on a large error: it is the baseline the estimator work improves.
#
# Usage: python3 tools/compare_torch2.py [--table FILE] [--memanat ./memanat] [--tsv]
# Standard library only; run from the repository root after `make memanat`.
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(path):
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            c = line.rstrip("\n").split("\t")
            yield {"name": c[0], "peak": int(c[1]), "cats": [int(x) for x in c[2:9]],
                   "phase": c[9], "attn": c[10], "args": c[11]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default=os.path.join(REPO, "test", "validation", "torch2.tsv"))
    ap.add_argument("--memanat", default=os.path.join(REPO, "memanat"))
    ap.add_argument("--tsv", action="store_true", help="tab-separated output")
    ap.add_argument("--allocated", action="store_true",
                    help="compare peak_allocated (with the allocator's unsplit block remainders, "
                         "which MemTracker cannot see) instead of peak_requested")
    a = ap.parse_args()
    mib = 2.0 ** 20
    errs, out = [], []
    for r in rows(a.table):
        cmd = [a.memanat, "estimate"] + r["args"].split() + ["--json"]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if p.returncode not in (0, 1):  # 1: does not fit the device, the numbers still printed
            out.append((r["name"], r["peak"], None, None, None, r["phase"], "",
                        "memanat failed: " + (p.stderr.strip().splitlines() or ["?"])[-1]))
            continue
        j = json.loads(p.stdout)
        pred_all = j["peak_allocated"]
        key = "peak_allocated" if a.allocated else "peak_requested"
        pred = j.get(key, pred_all) - j.get("workspace", 0)
        err = (pred - r["peak"]) / r["peak"]
        errs.append((abs(err), err, r["name"]))
        out.append((r["name"], r["peak"], pred, pred_all, err, r["phase"],
                    j.get("peak_phase", ""), ""))
    if a.tsv:
        print("name\tmeasured\tpredicted_no_ws\tpredicted\terror\tmeasured_phase\tpredicted_phase")
    else:
        print("%-40s %10s %10s %10s %8s  %-11s %-9s" % (
            "row", "meas MiB", "pred MiB", "+ws MiB", "error", "meas peak", "pred peak"))
    for name, m, pr, pa, e, ph, pph, note in out:
        if pr is None:
            print("%-40s %10.1f  %s" % (name, m / mib, note))
        elif a.tsv:
            print("%s\t%d\t%d\t%d\t%.4f\t%s\t%s" % (name, m, pr, pa, e, ph, pph))
        else:
            print("%-40s %10.1f %10.1f %10.1f %+7.1f%%  %-11s %-9s" % (
                name, m / mib, pr / mib, pa / mib, 100 * e, ph, pph))
    if errs:
        absv = [e[0] for e in errs]
        worst = max(errs)
        print("\n%d rows compared (%d failed); |error| median %.1f%%, mean %.1f%%, worst %.1f%% (%s);"
              " within 3%%: %d; under-predicted: %d" % (
                  len(errs), len(out) - len(errs), 100 * statistics.median(absv),
                  100 * statistics.mean(absv), 100 * worst[1], worst[2],
                  sum(1 for x in absv if x <= 0.03), sum(1 for e in errs if e[1] < 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
