#!/usr/bin/env python3
"""Runs `memanat fit` and `memanat estimate` over a grid of setups with two builds of the CLI and
reports every output that differs (stdout, stderr and exit status, text and --json).

    python3 tools/compare_fit.py OLD_BINARY NEW_BINARY [--quick] [--seed N]

The grid: every preset of `NEW models`, several GPUs, precisions, batch and sequence lengths,
checkpointing, optimizers, ZeRO with offload, LoRA/QLoRA and generation, drawn from a fixed seed
so that both builds see the same setups. Exit status 1 when any output differs."""
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

GPUS = ["t4", "v100-16gb", "rtx4090", "a10g", "a100-40gb", "a100-80gb", "h100-80gb", "h200"]
PRECS = ["fp32", "fp16", "bf16", "bf16-pure"]
OPTIMS = ["adamw", "adamw-8bit", "sgd", "adafactor", "lion"]


def presets(binary):
    out = subprocess.run([binary, "models"], capture_output=True, text=True, check=True).stdout
    names = []
    for line in out.splitlines()[1:]:
        if not line.strip():
            break
        names.append(line.split()[0])
    return names


def positions(model):  # learned position tables: the longest sequence the model takes
    for prefix, n in (("bert", 512), ("gpt2", 1024), ("starcoder", 8192)):
        if model.startswith(prefix):
            return n
    return 1 << 20


def grid(models, quick, seed):
    rng = random.Random(seed)
    runs = []
    per_model = 4 if quick else 12
    for m in models:
        for i in range(per_model):
            gpu = rng.choice(GPUS)
            a = ["--model", m, "--gpu", gpu]
            pos = positions(m)
            if rng.random() < 0.15:  # generation
                new = rng.choice([1, 64, 256])
                prompt = rng.choice([p for p in (128, 512, 2048, 8192) if p + new <= pos])
                a += ["--infer", "--prompt", str(prompt), "--new-tokens", str(new),
                      "--batch", str(rng.choice([1, 4, 16]))]
                if rng.random() < 0.4:
                    a += ["--quant", rng.choice(["int8", "nf4", "nf4-dq"])]
            else:
                precs = PRECS if gpu not in ("t4", "v100-16gb") else ["fp32", "fp16"]
                a += ["--precision", rng.choice(precs),
                      "--batch", str(rng.choice([1, 2, 4, 8, 16, 64])),
                      "--seq", str(rng.choice([s for s in (128, 512, 1024, 2048, 4096, 8192)
                                               if s <= pos]))]
                r = rng.random()
                if r < 0.25:
                    a += ["--checkpointing", rng.choice(["full", "selective"])]
                if rng.random() < 0.3:
                    a += ["--optim", rng.choice(OPTIMS)]
                if rng.random() < 0.15:
                    z = rng.choice([1, 2, 3])
                    a += ["--framework", "deepspeed", "--zero", str(z), "--gpus", "8",
                          "--offload", rng.choice(["none", "optimizer", "all"] if z == 3 else
                                                  ["none", "optimizer"])]
                elif rng.random() < 0.2:
                    a += ["--lora-rank", str(rng.choice([8, 16, 64]))]
                    if rng.random() < 0.5:
                        a += ["--quant", "nf4-dq"]
                if rng.random() < 0.15:
                    a += ["--attention", rng.choice(["eager", "sdpa"])]
                if rng.random() < 0.1:
                    a += ["--accum", "4"]
                if rng.random() < 0.05:
                    a += ["--alloc-conf", "max_split_size_mb:128"]
                if rng.random() < 0.05:
                    a += ["--no-replay"]
            if rng.random() < 0.1:
                a += ["--capacity", rng.choice(["12GiB", "20GiB", "30GiB"])]
            cmd = "fit" if i % 3 else "estimate"
            runs.append([cmd] + a)
            if i % 4 == 1:
                runs.append([cmd, "--json"] + a)
    return runs


def run(binary, args):
    p = subprocess.run([binary] + args, capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def main():
    old, new = sys.argv[1], sys.argv[2]
    quick = "--quick" in sys.argv[3:]
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 20261126
    runs = grid(presets(new), quick, seed)
    with ThreadPoolExecutor(max_workers=2) as ex:
        a = list(ex.map(lambda r: run(old, r), runs))
        b = list(ex.map(lambda r: run(new, r), runs))
    bad = 0
    codes = {}
    for r, x, y in zip(runs, a, b):
        codes[x[0]] = codes.get(x[0], 0) + 1
        if x != y:
            bad += 1
            if bad <= 10:
                print("DIFFERS:", " ".join(r))
    kinds = {k: sum(1 for r in runs if r[0] == k) for k in ("fit", "estimate")}
    print(f"{len(runs)} runs ({kinds['fit']} fit, {kinds['estimate']} estimate; exit codes "
          f"{dict(sorted(codes.items()))}): {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
