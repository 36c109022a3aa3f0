"""Shared fixtures: where the repository, the CLI and the validation set are."""
import json
import os
import shlex
import subprocess
from typing import Any, Dict, List, Tuple

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEV_TSV = os.path.join(ROOT, "..", "shared", "validation", "dev.tsv")


def cli_path() -> str:
    """The CLI the C tests run (MEMANAT_BIN, else ./memanat), absolute."""
    p = os.environ.get("MEMANAT_BIN") or "memanat"
    return p if os.path.isabs(p) else os.path.join(ROOT, p)


def run_cli(args: List[str]) -> Tuple[int, str, str]:
    """Runs the CLI from the repository root (dev.tsv's paths are relative to it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    p = subprocess.run([cli_path()] + args, cwd=ROOT, capture_output=True, text=True, env=env)
    return p.returncode, p.stdout, p.stderr


def cli_json(args: List[str]) -> Dict[str, Any]:
    rc, out, err = run_cli(args + ["--json"])
    # 1: the step does not fit (estimate) or no plan fits (fit); the answer is printed all the same
    assert rc in (0, 1), "memanat %s: exit %d: %s" % (" ".join(args), rc, err)
    return json.loads(out)


def flags_to_kwargs(args: List[str]) -> Dict[str, Any]:
    """`--lora-rank 16 --infer` -> {"lora_rank": "16", "infer": True}: the CLI's spelling of a
    setting is its keyword with dashes; values stay the CLI's text (the package reads both)."""
    out: Dict[str, Any] = {}
    i = 0
    while i < len(args):
        key = args[i]
        assert key.startswith("--"), key
        name = key[2:].replace("-", "_")
        if name == "infer":
            out[name] = True
            i += 1
            continue
        out[name] = args[i + 1]
        i += 2
    return out


def dev_rows() -> List[Tuple[str, List[str]]]:
    """(id, CLI arguments) of every row of ../shared/validation/dev.tsv, read as test_cli.c
    reads it: tab-separated id, metric, unit, value, tol, args, source; '#' starts a comment."""
    rows = []
    if not os.path.exists(DEV_TSV):
        return rows
    with open(DEV_TSV, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            col = line.rstrip("\n").split("\t")
            rows.append((col[0], shlex.split(col[5])))
    return rows


@pytest.fixture(autouse=True)
def _no_env_alloc_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI runs without these; the package must too, to compare."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


@pytest.fixture(autouse=True)
def _need_cli() -> None:
    if not os.access(cli_path(), os.X_OK):
        pytest.skip("%s not built (make builds it)" % cli_path())


def write_checkpoint(folder: str, rng: Any, shards: int = 2) -> Dict[str, Any]:
    """A small model folder made here: a llama config.json and its weights as safetensors
    shards (random names, shapes and dtypes; zero-filled data), with model.safetensors.index.json
    when sharded. Returns {"params": the elements written, "dtype": the dtype holding the most,
    "files": [shard paths], "index": the index path or None}; the bytes follow the safetensors
    format spec (8-byte little-endian header length, JSON header padded with spaces, data)."""
    import struct
    os.makedirs(folder, exist_ok=True)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 512,
           "torch_dtype": "float32"}
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    size = {"F32": 4, "BF16": 2, "F16": 2}
    per_dtype: Dict[str, int] = {}
    files, weight_map = [], {}
    for s in range(shards):
        name = ("model-%05d-of-%05d.safetensors" % (s + 1, shards)) if shards > 1 \
            else "model.safetensors"
        header, offset = {}, 0
        for t in range(rng.randint(2, 5)):
            dt = rng.choice(["BF16", "BF16", "F32", "F16"])
            # the first tensor alone exceeds the config's shape count (115,008): an exact
            # count pads the model up to it, never down (memanat.h mn__build_params)
            shape = [rng.randint(460, 900), 256] if t == 0 else \
                [rng.randint(1, 40) for _ in range(rng.randint(1, 3))]
            n = 1
            for d in shape:
                n *= d
            key = "model.layers.%d.w%d.weight" % (s, t)
            header[key] = {"dtype": dt, "shape": shape,
                           "data_offsets": [offset, offset + n * size[dt]]}
            offset += n * size[dt]
            per_dtype[dt] = per_dtype.get(dt, 0) + n
            weight_map[key] = name
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + b"\0" * offset)
        files.append(path)
    index = None
    if shards > 1:
        index = os.path.join(folder, "model.safetensors.index.json")
        with open(index, "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return {"params": sum(per_dtype.values()), "dtype": max(per_dtype, key=per_dtype.get),
            "files": files, "index": index, "config": cfg}
