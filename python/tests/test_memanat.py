"""The Python package against the CLI: both are memanat.h, so every number must be the same.

The reference is the `memanat` binary (built by `make`); each test runs it and the package on
the same setup and compares the whole JSON answer, or the bytes of the pictures.
"""
import json
import os
import pickle
import random
import re
import threading

import pytest

import memanat
from conftest import DEV_TSV, ROOT, cli_json, dev_rows, flags_to_kwargs, run_cli

ROWS = dev_rows()


def test_dev_tsv_present() -> None:
    assert os.path.exists(DEV_TSV), "the validation set lives in ../shared beside the checkout"
    assert len(ROWS) >= 19


@pytest.mark.parametrize("row_id,args", ROWS, ids=[r[0] for r in ROWS])
def test_dev_row_same_as_cli(row_id: str, args: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key of `memanat estimate ARGS --json` (bytes and resolved settings) is the same
    through memanat.estimate(**kwargs) with the flags as keywords."""
    want = cli_json(["estimate"] + args)
    monkeypatch.chdir(ROOT)  # the rows' config paths are relative to the checkout
    got = memanat.estimate(**flags_to_kwargs(args))
    for key, value in want.items():
        assert got[key] == value, "%s: %s got %r want %r" % (row_id, key, got[key], value)


@pytest.mark.parametrize("row_id,args", ROWS[::4], ids=[r[0] for r in ROWS[::4]])
def test_dev_row_fit_same_as_cli(row_id: str, args: list, monkeypatch: pytest.MonkeyPatch) -> None:
    want = cli_json(["fit"] + args)
    monkeypatch.chdir(ROOT)
    got = memanat.fit(**flags_to_kwargs(args))
    mine = got.to_dict()
    est = want.pop("estimate")
    assert {k: mine[k] for k in want} == want, row_id
    assert {k: mine["estimate"][k] for k in est} == est, row_id
    assert got.max_batch == want["max_batch"]
    assert [p.what for p in got.plan] == [p["what"] for p in want["plan"]]


def test_plan_settings_reach_the_plan_estimate() -> None:
    """The plan's steps, applied as keywords, give the estimate the plan arrived at."""
    f = memanat.fit("llama-2-7b", gpu="a10g", batch=4, seq=1024)
    assert f.plan and f.plan_found
    setup = {"batch": 4, "seq": 1024, "gpu": "a10g"}
    for step in f.plan:
        setup.update(step.settings)
    e = memanat.estimate("llama-2-7b", **setup)
    assert e.fits and e.device_used == f.estimate.device_used


def random_setup(rng: random.Random, presets: list) -> list:
    """A fresh random training or inference setup as CLI flags."""
    args = ["--model", rng.choice(presets)]
    if rng.random() < 0.2:
        # prompt + new tokens within 512 positions (the smallest learned table among the presets)
        return args + ["--infer", "--batch", str(rng.randint(1, 8)), "--prompt",
                       str(rng.choice([16, 128, 256])), "--new-tokens", str(rng.randint(0, 256))]
    args += ["--batch", str(rng.randint(1, 16)), "--seq", str(rng.choice([64, 128, 256, 500]))]
    precision = rng.choice(["fp32", "fp16", "bf16", "bf16-pure"])
    args += ["--precision", precision]
    args += ["--optim", rng.choice(["adamw", "adamw-8bit", "sgd", "adafactor", "lion"])]
    args += ["--checkpointing", rng.choice(["none", "full", "selective"])]
    args += ["--attention", rng.choice(["eager", "sdpa"])]
    # bf16 needs sm 80: the T4 and the V100 refuse it
    args += ["--gpu", rng.choice(["a100-80gb", "h100-80gb"] if precision.startswith("bf16")
                                 else ["a100-80gb", "t4", "h100-80gb", "v100-16gb"])]
    if rng.random() < 0.3:
        args += ["--lora-rank", str(rng.choice([4, 8, 64])), "--quant",
                 rng.choice(["none", "nf4", "int8"])]
    if rng.random() < 0.3:
        args += ["--gpus", str(rng.choice([2, 8])), "--zero", str(rng.randint(0, 3)),
                 "--framework", "deepspeed"]
    if rng.random() < 0.3:
        args += ["--alloc-conf", rng.choice(["expandable_segments:True",
                                             "max_split_size_mb:128",
                                             "roundup_power2_divisions:4"])]
    return args


def test_random_setups_same_as_cli() -> None:
    """Fresh random setups over the small presets (the seed is printed on failure)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    small = [m["name"] for m in memanat.models()["models"] if m["params"] < 2e9]
    assert small
    for _ in range(12):
        args = random_setup(rng, small)
        want = cli_json(["estimate"] + args)
        got = memanat.estimate(**flags_to_kwargs(args))
        diff = {k: (got[k], v) for k, v in want.items() if got[k] != v}
        assert not diff, "seed %d: %s: got/want %s" % (seed, " ".join(args), diff)


def test_svg_and_parts_same_bytes_as_cli(tmp_path) -> None:
    svg = tmp_path / "step.svg"
    args = ["estimate", "--model", "gpt2", "--batch", "2", "--seq", "256", "--precision", "bf16"]
    want = cli_json(args + ["--svg", str(svg), "--parts"])
    e = memanat.estimate("gpt2", batch=2, seq=256, precision="bf16", parts=True)
    assert e["parts"] == want["parts"]
    assert e.to_svg() == svg.read_text(encoding="utf-8")


def test_explain_same_as_cli() -> None:
    """explain=True gives the groups `memanat estimate --explain --json` prints."""
    args = ["estimate", "--model", "llama-3.2-1b", "--batch", "2", "--seq", "512", "--precision",
            "bf16", "--lora-rank", "8", "--lora-dropout", "0.1", "--optim-impl", "loop"]
    want = cli_json(args + ["--explain"])
    e = memanat.estimate("llama-3.2-1b", batch=2, seq=512, precision="bf16", lora_rank=8,
                         lora_dropout=0.1, optim_impl="loop", explain=True)
    assert e["explain"] == want["explain"] and e["explain_peak"] == want["explain_peak"]
    assert sum(g["bytes"] for g in e["explain"]) == e["explain_peak"]


def test_breakdown() -> None:
    e = memanat.estimate("llama-3-8b", batch=1, seq=1024, precision="bf16", lora_rank=16,
                         quant="nf4", gpu="a10g")
    b = e.breakdown
    assert set(memanat.CATEGORIES) <= set(b)
    assert all(isinstance(v, int) and v >= 0 for v in b.values())
    assert b["allocator_slack"] == e.peak_reserved - e.peak_allocated
    assert e.context + e.peak_reserved == e.device_used
    assert sum(e.at_peak.values()) <= e.peak_allocated
    assert e.fits == (e.device_used <= e.capacity)
    assert "fits" in repr(e)
    json.dumps(e.to_dict())


def test_params_and_text_counts() -> None:
    """An int, a float and the CLI's text give the same setup."""
    a = memanat.estimate(7_500_000_000, precision="fp16", framework="deepspeed", gpus=64, zero=1)
    b = memanat.estimate(params="7.5e9", precision="fp16", framework="deepspeed", gpus="64",
                         zero=1)
    c = memanat.estimate(params=7.5e9, precision="fp16", framework="deepspeed", gpus=64, zero=1)
    assert a.to_dict() == b.to_dict() == c.to_dict()
    want = cli_json(["estimate", "--params", "7.5e9", "--precision", "fp16", "--framework",
                     "deepspeed", "--gpus", "64", "--zero", "1"])
    assert a.model_states == want["model_states"]


def test_config_dict_and_path(tmp_path) -> None:
    path = os.path.join(ROOT, "..", "shared", "validation", "configs", "gpt2-xl.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    by_path = memanat.estimate(path, batch=2, seq=512)
    by_kw = memanat.estimate(config=path, batch=2, seq=512)
    by_dict = memanat.estimate(cfg, batch=2, seq=512)
    assert by_path.device_used == by_kw.device_used == by_dict.device_used
    want = cli_json(["estimate", "--config", path, "--batch", "2", "--seq", "512"])
    assert by_dict.device_used == want["device_used"]


def test_alloc_conf_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the CLI: PYTORCH_ALLOC_CONF configures the allocator model when alloc_conf is not
    given."""
    plain = memanat.estimate("gpt2", batch=8, seq=512)
    given = memanat.estimate("gpt2", batch=8, seq=512, alloc_conf="expandable_segments:True")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from_env = memanat.estimate("gpt2", batch=8, seq=512)
    assert from_env.to_dict() == given.to_dict()
    assert plain.to_dict() != given.to_dict()


BAD = [
    # (keywords, exception class), each the twin of a line of test_cli.c's bad-input list
    ({"config": "no-such-model"}, memanat.NotFoundError),
    ({"config": "gpt2", "batch": 0}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "batch": -1}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "batch": 1e30}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "batch": 2.5}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "batch": "many"}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "batch": True}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "seq": 4096}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "precision": "fp8"}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "gpu": "tpu"}, memanat.MemanatError),
    ({"config": "gpt2", "capacity": "lots"}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "zero": 7}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "lora_targets": "q,x"}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "quant": "nf4"}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "torch": 3}, memanat.InvalidArgumentError),
    ({"config": "gpt2", "context": "1TiB"}, memanat.InvalidArgumentError),
    ({"params": 0}, memanat.InvalidArgumentError),
    ({"params": 1e19}, memanat.InvalidArgumentError),
    ({"params": 7e9, "trainable_params": 8e9}, memanat.InvalidArgumentError),
    ({"model": "gpt2", "params": 7e9}, memanat.InvalidArgumentError),
    ({}, memanat.InvalidArgumentError),
]


@pytest.mark.parametrize("kwargs,exc", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_input_raises(kwargs: dict, exc: type) -> None:
    with pytest.raises(exc) as info:
        memanat.estimate(**kwargs)
    err = info.value
    assert isinstance(err, memanat.MemanatError) and err.code < 0
    assert str(err) and "\n" not in str(err)


def test_bad_input_matches_cli_refusal() -> None:
    """Where the CLI exits 2 with a reason, the package raises; the library's reason (not the
    CLI's own wording) is the same text."""
    rc, _, err = run_cli(["estimate", "--model", "gpt2", "--seq", "4096"])
    assert rc == 2
    with pytest.raises(memanat.InvalidArgumentError) as info:
        memanat.estimate("gpt2", seq=4096)
    assert str(info.value) in err


def test_unknown_keyword_is_type_error() -> None:
    with pytest.raises(TypeError, match="frobnicate"):
        memanat.estimate("gpt2", frobnicate=3)
    with pytest.raises(TypeError):
        memanat.estimate(object())
    with pytest.raises(TypeError):
        memanat.estimate("gpt2", model="gpt2")


def test_bad_config_files(tmp_path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": [}')
    with pytest.raises(memanat.ParseError):
        memanat.estimate(str(broken))
    with pytest.raises(memanat.ParseError):
        memanat.estimate(broken)  # a Path
    moe = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "intermediate_size": 14336, "vocab_size": 32000,
           "num_local_experts": 8}
    with pytest.raises(memanat.UnsupportedError):
        memanat.estimate(moe)
    with pytest.raises(memanat.InvalidArgumentError):
        memanat.estimate({"model_type": "llama", "hidden_size": -5})
    with pytest.raises(memanat.MemanatError):
        memanat.estimate(config=str(tmp_path / "absent.json"))
    with pytest.raises(memanat.MemanatError) as info:  # a missing path is not a preset name
        memanat.estimate(str(tmp_path / "absent" / "config.json"))
    assert "absent" in str(info.value) and "unknown model" not in str(info.value)


def test_every_cli_setting_is_a_keyword() -> None:
    """The flags `memanat estimate --help` lists are the package's keywords (output flags
    aside): a flag added to the CLI shows here until the package has it too."""
    rc, out, _ = run_cli(["estimate", "--help"])
    assert rc == 0
    flags = {f[2:].replace("-", "_") for f in re.findall(r"--[a-z][a-z0-9-]*", out)}
    outputs = {"json", "svg", "snapshot", "parts", "explain"}
    missing = sorted(flags - outputs - set(memanat.options()))
    assert not missing, "CLI flags the Python package does not take: %s" % missing


def test_threads_share_nothing() -> None:
    """Calls in parallel threads (the GIL is released) give each its own answer."""
    setups = [dict(batch=b, seq=256) for b in (1, 2, 3, 4, 5, 6)]
    want = [memanat.estimate("gpt2", **s).device_used for s in setups]
    got = [0] * len(setups)

    def work(i: int) -> None:
        for _ in range(3):
            got[i] = memanat.estimate("gpt2", **setups[i]).device_used

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(setups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert len(set(want)) == len(want)


def test_models() -> None:
    m = memanat.models()
    names = {x["name"] for x in m["models"]}
    assert {"llama-3-8b", "bert-large-uncased", "gpt2"} <= names
    assert any(g["name"] == "h100-80gb" for g in m["gpus"])
    rc, out, _ = run_cli(["models"])
    for name in names:
        assert name in out


def test_replay_snapshot_json_and_pickle(tmp_path) -> None:
    """A snapshot of a predicted step replayed by the CLI and by the package, from JSON and
    from the pickle torch.cuda.memory._dump_snapshot() writes."""
    snap = tmp_path / "step.json"
    cli_json(["estimate", "--model", "gpt2", "--batch", "2", "--seq", "128", "--snapshot",
              str(snap)])
    want = cli_json(["replay", str(snap)])
    got = memanat.replay(str(snap))
    assert dict(got.items()) == want
    data = json.loads(snap.read_text())
    pkl = tmp_path / "step.pickle"
    with open(pkl, "wb") as f:
        pickle.dump(data, f)
    assert dict(memanat.replay(pkl).items()) == want
    assert dict(memanat.replay(data).items()) == want
    assert got.peak_reserved >= got.peak_allocated > 0
    small = memanat.replay(data, capacity="64MiB")
    assert small["num_ooms"] > 0
    assert small["num_ooms"] == cli_json(["replay", str(snap), "--capacity", "64MiB"])["num_ooms"]
    svg = tmp_path / "replay.svg"
    cli_json(["replay", str(snap), "--svg", str(svg)])
    assert got.to_svg().startswith("<svg")


def test_replay_refuses_bad_snapshots(tmp_path) -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"device_traces": [[Evil()]]}))
    with pytest.raises(memanat.ParseError):
        memanat.replay(evil)
    with pytest.raises(memanat.InvalidArgumentError):
        memanat.replay({"segments": []})
    with pytest.raises(memanat.ParseError):
        memanat.replay({"device_traces": [[{"action": "alloc", "addr": "x", "size": 3}]]})
    bad = tmp_path / "bad.json"
    bad.write_text("{ nope")
    with pytest.raises(memanat.ParseError):
        memanat.replay(bad)


def test_transformers_config_object(tmp_path) -> None:
    """A real transformers config object gives the numbers of the same config.json on disk
    through the CLI."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    for cfg in (transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4),
                transformers.LlamaConfig(hidden_size=512, intermediate_size=1376,
                                         num_hidden_layers=4, num_attention_heads=8,
                                         num_key_value_heads=2, vocab_size=32000),
                transformers.BertConfig(num_hidden_layers=2, architectures=["BertForMaskedLM"])):
        folder = tmp_path / cfg.model_type
        cfg.save_pretrained(str(folder))
        want = cli_json(["estimate", "--config", str(folder / "config.json"), "--batch", "3",
                         "--seq", "128", "--precision", "bf16"])
        got = memanat.estimate(cfg, batch=3, seq=128, precision="bf16")
        for key in ("weights", "gradients", "optimizer", "activations", "peak_reserved",
                    "device_used", "params"):
            assert got[key] == want[key], (cfg.model_type, key)


def test_seq_lengths_same_as_cli(tmp_path) -> None:
    """A distribution of sequence lengths (range, file, or a list) gives the CLI's answer."""
    rng = random.Random()
    lo = rng.choice([16, 32, 64])
    hi = lo * rng.choice([4, 8])
    spec = "%d:%d:%d" % (lo, hi, (lo + hi) // 3)
    steps, seed = rng.randint(2, 8), rng.randint(0, 99)
    want = cli_json(["estimate", "--model", "gpt2", "--batch", "2", "--seq-lengths", spec,
                     "--steps", str(steps), "--seed", str(seed), "--percentile", "90"])
    got = memanat.estimate("gpt2", batch=2, seq_lengths=spec, steps=steps, seed=seed,
                           percentile=90)
    assert got["seq_lengths"] == want["seq_lengths"]
    assert {k: got[k] for k in want} == want
    lengths = [rng.randint(8, 300) for _ in range(40)]
    path = tmp_path / "lengths.txt"
    path.write_text("".join("%d\n" % n for n in lengths))
    want = cli_json(["estimate", "--model", "gpt2", "--seq-lengths", str(path), "--steps", "4"])
    assert memanat.estimate("gpt2", seq_lengths=path, steps=4)["seq_lengths"] == \
        want["seq_lengths"]
    assert memanat.estimate("gpt2", lengths=lengths, steps=4)["seq_lengths"] == \
        want["seq_lengths"]
    with pytest.raises(memanat.InvalidArgumentError):
        memanat.estimate("gpt2", seq=128, seq_lengths=spec)
    with pytest.raises(memanat.InvalidArgumentError):
        memanat.estimate("gpt2", steps=4)
    with pytest.raises(memanat.InvalidArgumentError):
        memanat.estimate("gpt2", seq_lengths=spec, percentile=0)


def test_bitsandbytes_settings_same_as_cli() -> None:
    for quant, bnb, head in (("nf4", "0.43.1", "yes"), ("fp4-dq", "0.44.0", "no")):
        want = cli_json(["estimate", "--model", "llama-2-7b", "--lora-rank", "8", "--quant",
                         quant, "--bnb-version", bnb, "--quant-head", head, "--seq", "256"])
        got = memanat.estimate("llama-2-7b", lora_rank=8, quant=quant, bnb_version=bnb,
                               quant_head=head == "yes", seq=256)
        assert {k: got[k] for k in want} == want
    with pytest.raises(memanat.InvalidArgumentError):
        memanat.estimate("llama-2-7b", lora_rank=8, quant="nf4", bnb_version="latest")


def test_safetensors_folder_and_headers_same_as_cli(tmp_path) -> None:
    """A model folder's safetensors headers give the exact parameter count and dtype: through
    a path as the CLI reads it, and through the headers alone (what the page sends)."""
    import base64
    from conftest import write_checkpoint
    rng = random.Random()
    for shards in (1, rng.randint(2, 4)):
        folder = str(tmp_path / ("ckpt%d" % shards))
        ck = write_checkpoint(folder, rng, shards)
        want = cli_json(["estimate", "--config", folder, "--seq", "64"])
        assert want["params"] == ck["params"]  # the CLI read the headers written here
        got = memanat.estimate(folder, seq=64)
        assert got.params == want["params"] and got.device_used == want["device_used"]
        assert got.weights == want["weights"]
        req = {"config_json": json.dumps(ck["config"]), "seq": 64, "safetensors": []}
        for path in ck["files"]:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                f.seek(0)
                head = f.read(8 + n)
            req["safetensors"].append({"name": os.path.basename(path),
                                       "size": os.path.getsize(path),
                                       "header_base64": base64.b64encode(head).decode()})
        if ck["index"]:
            with open(ck["index"], encoding="utf-8") as f:
                req["safetensors_index"] = f.read()
        out = memanat._call("estimate", req)
        for k in ("params", "weights", "gradients", "optimizer", "device_used"):
            assert out[k] == want[k], k
        assert out["safetensors"]["params"] == ck["params"]
        assert out["safetensors"]["dtype"] == ck["dtype"]
        if ck["index"]:  # a shard the index names is missing
            with pytest.raises(memanat.MemanatError, match="listed in the index, missing"):
                memanat._call("estimate", dict(req, safetensors=req["safetensors"][1:]))
        bad = dict(req, safetensors=[dict(req["safetensors"][0], size=3)])
        bad.pop("safetensors_index", None)
        with pytest.raises(memanat.MemanatError, match="safetensors"):
            memanat._call("estimate", bad)
