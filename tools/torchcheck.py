#!/usr/bin/env python3
# torchcheck.py: peak allocated memory of two training steps of the REAL transformers/peft
# modelling code, measured without a GPU.
#
# The model is built and trained under torch's FakeTensorMode (no data, no kernels; shapes,
# dtypes, strides and storage lifetimes are the real ones) inside torch's MemTracker
# (torch.distributed._tools.mem_tracker), which keeps the live bytes of every storage per category
# (parameters, buffers, gradients, activations, temporaries, optimizer state) and the peak.
# MemTracker rounds every cuda storage up to 512 B, the caching allocator's minimum block
# (kMinBlockSize); blocks are not split or cached, so this is torch.cuda.max_memory_allocated()
# of the step, minus what no dispatcher-level tool sees (CUDA context, cuBLAS/cuDNN workspaces,
# kernels' internal scratch, allocator fragmentation and reserved memory).
#
# The fake tensors live on the "cpu" device, with what differs on CUDA put back (section 2):
# with the PyPI torch wheel (CUDA build) and no driver, fake "cuda" tensors run forward but the
# autograd engine asks the driver for a primary context in backward (hasPrimaryContext) and
# fails. So: (a) the CUDA autocast policy is installed as the AutocastCPU kernels (the op set is
# read from the dispatcher: every aten op with an AutocastCUDA kernel, each with its CUDA policy:
# lower precision, fp32, fp32 output dtype, promote; CPU-only autocast kernels fall through;
# weight casts cached until the outermost autocast exits, as autocast's cast cache does);
# (b) dropout takes native_dropout (bool mask) as it does on CUDA, not the CPU's float mask;
# (c) storages are rounded to 512 B as on cuda; (d) SDPA is routed as below.
#
# One step = forward with labels (under autocast for the mixed precisions), loss.backward(),
# optimizer.step() with foreach=True (torch's default for CUDA parameters; fake parameters would
# take the per-tensor loop), optimizer.zero_grad(set_to_none=True); the model outputs are dropped
# after zero_grad, as in a plain loop. Two steps: the second one has the optimizer state alive.
#
# scaled_dot_product_attention is routed as torch's select_sdp_backend does on sm80/sm90
# (priority torch._C._get_sdp_priority_order(), default flash > efficient > math > cudnn): flash
# for fp16/bf16 without a mask (GQA allowed), memory-efficient for fp32/fp16/bf16 with or without
# a mask but not for GQA with kv heads != q heads, math otherwise. Under FakeTensorMode torch
# cannot query the device and would take the math path for everything.
#
# Usage: see tools/README.md.  python tools/torchcheck.py --family gpt2 --batch 4 --seq 512 ...
#        python tools/torchcheck.py --table        (the rows of test/validation/torch2.tsv)
#        python tools/torchcheck.py --validate     (MemTracker vs profiler on the CPU, real tensors)
import argparse
import contextlib
import json
import math
import os
import sys
import warnings

VERSION = "torchcheck 1"

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.common_utils import get_untyped_storages  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker, _TOTAL_KEY  # noqa: E402

import transformers  # noqa: E402

from torch.distributed._tools import mem_tracker as _mt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join("test", "validation", "configs-torch2")

# ---------------------------------------------------------------------------------------------
# 1. Model families: a transformers config class with sizes small enough to run in seconds under
#    FakeTensorMode (the cost is per op, not per byte) but real head dims, vocabularies and shapes.
# ---------------------------------------------------------------------------------------------

FAMILIES = {
    # GPT-2 small (124M), dropout 0.1 everywhere, gelu_new, tied embeddings.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict()),
    # TinyLlama-like, MHA, 8 layers.
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                   max_position_embeddings=4096, tie_word_embeddings=False)),
    # Mistral-like GQA (4 kv heads for 16), no sliding window.
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                     max_position_embeddings=4096, sliding_window=None,
                     tie_word_embeddings=False)),
    # Qwen2-0.5B shapes (GQA 14/2, 152k vocab, tied embeddings, qkv bias), 6 layers.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=6,
                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                   max_position_embeddings=4096, tie_word_embeddings=True)),
    # BERT-base encoder with a 2-label classification head.
    "bert": ("BertConfig", "BertForSequenceClassification", dict(num_labels=2)),
    # Gemma-2B-like MQA (8 heads, 1 kv head, head_dim 256, GeGLU, 256k vocab), 4 layers.
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                   vocab_size=256000, max_position_embeddings=4096)),
    # Phi-3-mini-like (fused qkv and gate_up projections), 4 layers.
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=16, vocab_size=32064,
                  max_position_embeddings=4096, sliding_window=None)),
}

# LoRA targets per family in transformers module names and in memanat's --lora-targets words.
LORA_TARGETS = {
    "gpt2": (["c_attn"], "q,k,v"),  # GPT-2's fused qkv Conv1D
    "bert": (["query", "value"], "q,v"),
    "phi3": (["qkv_proj"], "q,k,v"),
}
DEFAULT_LORA = (["q_proj", "v_proj"], "q,v")

PRECISIONS = {  # name -> (autocast dtype or None, parameter dtype, memanat --precision)
    "fp32": (None, torch.float32, "fp32"),
    "bf16": (torch.bfloat16, torch.float32, "bf16"),  # autocast bf16, fp32 weights
    "fp16": (torch.float16, torch.float32, "fp16"),  # autocast fp16, fp32 weights
    "bf16-pure": (None, torch.bfloat16, "bf16-pure"),
}


def make_config(family, overrides, attention):
    cfg_name, model_name, sizes = FAMILIES[family]
    cfg_cls = getattr(transformers, cfg_name)
    kw = dict(sizes)
    kw.update(overrides)
    cfg = cfg_cls(**kw)
    cfg.architectures = [model_name]
    cfg._attn_implementation = attention
    return cfg, getattr(transformers, model_name)


def config_path(family, overrides):
    tag = family + "".join("-%s%s" % (k.split("_")[-1][:6], v)
                           for k, v in sorted(overrides.items()))
    return os.path.join(CONFIG_DIR, tag + ".json")


def write_config(cfg, path):
    d = cfg.to_dict()
    for k in ("_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
              "transformers_version", "dtype", "torch_dtype"):
        d.pop(k, None)
    full = os.path.join(REPO, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
        f.write("\n")



# ---------------------------------------------------------------------------------------------
# 2a. CUDA behaviour on fake cpu tensors (see the header).
# ---------------------------------------------------------------------------------------------

# CUDA autocast policy per op (aten/src/ATen/autocast_mode.cpp); the op set is checked against
# the dispatcher's AutocastCUDA kernels at install time and any op not named here is fp32.
_LOWER = {"_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
          "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
          "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr",
          "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
          "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
          "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_cudnn_rnn",
          "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"}
_PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
            "index_put", "tensordot", "scatter_add"}
_SET_OPT_DTYPE = {"prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                  "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                  "sum.dim_IntList"}
_EMU = {"installed": False, "cache": {}, "depth": 0, "ops": {}}


def _eligible(t):
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(x, dt, cache):
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dt, cache) for y in x)
    if not _eligible(x) or x.dtype == dt:
        return x
    if (dt != torch.float32 and x.dtype == torch.float32 and x.requires_grad and x.is_leaf
            and x._base is None):
        hit = cache.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        y = x.to(dt)
        cache[id(x)] = (x, y)
        return y
    return x.to(dt)


def _make_kernel(op, policy):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    names = [a.name for a in op._schema.arguments]
    dtype_pos = names.index("dtype") if "dtype" in names else None

    def kernel(*args, **kwargs):
        lp = torch.get_autocast_dtype("cpu")
        if policy == "lower":
            args, kwargs = _cast(args, lp, _EMU["cache"]), {k: _cast(v, lp, _EMU["cache"])
                                                              for k, v in kwargs.items()}
        elif policy == "promote":
            flat = [a for a in list(args) + list(kwargs.values()) if _eligible(a)]
            dt = torch.float32 if any(a.dtype == torch.float32 for a in flat) else lp
            args, kwargs = _cast(args, dt, {}), {k: _cast(v, dt, {}) for k, v in kwargs.items()}
        elif policy == "set_opt_dtype":
            if _eligible(args[0]):
                if dtype_pos is not None and len(args) > dtype_pos:
                    if args[dtype_pos] is None:
                        args = args[:dtype_pos] + (torch.float32,) + args[dtype_pos + 1:]
                elif kwargs.get("dtype") is None:
                    kwargs = dict(kwargs, dtype=torch.float32)
        else:
            args, kwargs = _cast(args, torch.float32, {}), {k: _cast(v, torch.float32, {})
                                                             for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(keys):
            return op(*args, **kwargs)
    return kernel


def install_cuda_emulation():
    if _EMU["installed"]:
        return
    _EMU["installed"] = True
    # module.to() swaps fake parameters; a no-op conversion (same dtype and device, as peft's
    # adapter moves are here) cannot be swapped with itself: skip it
    orig_swap = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        try:
            return orig_swap(t1, t2)
        except RuntimeError:
            if (t1.dtype, t1.device, t1.shape) == (t2.dtype, t2.device, t2.shape):
                return None
            raise
    torch.utils.swap_tensors = swap_tensors
    lib = torch.library.Library("aten", "IMPL")
    _EMU["lib"] = lib
    cuda_ops, cpu_ops = set(), set()
    for n in torch._C._dispatch_get_all_op_names():
        if not n.startswith("aten::"):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA"):
            cuda_ops.add(n[6:])
        if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU"):
            cpu_ops.add(n[6:])
    for name in sorted(cuda_ops):
        base, _, ov = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), ov or "default")
        policy = ("lower" if name in _LOWER else "promote" if name in _PROMOTE else
                  "set_opt_dtype" if name in _SET_OPT_DTYPE else "fp32")
        _EMU["ops"][name] = policy
        lib.impl(name, _make_kernel(op, policy), "AutocastCPU")
    for name in sorted(cpu_ops - cuda_ops):
        lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    # the cast cache lives until the outermost autocast region exits
    ac = torch.amp.autocast_mode.autocast
    enter, exit_ = ac.__enter__, ac.__exit__

    def __enter__(self):
        if self.device == "cpu":
            _EMU["depth"] += 1
        return enter(self)

    def __exit__(self, *a):
        r = exit_(self, *a)
        if self.device == "cpu":
            _EMU["depth"] -= 1
            if _EMU["depth"] == 0:
                _EMU["cache"].clear()
        return r
    ac.__enter__, ac.__exit__ = __enter__, __exit__
    # dropout as on CUDA: native_dropout keeps a bool mask; p == 0 or eval returns the input
    orig_dropout = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0 or input.numel() == 0:
            return input
        if p == 1.0 or inplace:
            return orig_dropout(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]
    F.dropout = dropout
    # transformers treats fake tensors as "tracing" and then keeps a packed-sequence mask where a
    # real run finds one sequence per row and drops the mask (flash stays possible); our
    # position ids are always 0..seq-1, so answer as a real run does
    import transformers.masking_utils as mu
    mu.find_packed_sequence_indices = lambda position_ids: None
    # storages rounded to the caching allocator's 512 B blocks on the fake device too
    _mt._WeakRefInfo._calculate_mem_consumed = (
        lambda self: math.ceil(self.size * self.element_size / 512) * 512)

# ---------------------------------------------------------------------------------------------
# 2b. SDPA routing (see the header). Inputs are cast as CUDA autocast casts them (SDPA is on its
#    lower-precision list) before the backend is chosen.
# ---------------------------------------------------------------------------------------------

_ORIG_SDPA = F.scaled_dot_product_attention
SDPA_LOG = []


def _choose_backend(q, k, v, attn_mask, enable_gqa):
    d = q.shape[-1]
    gqa = enable_gqa and q.shape[-3] != k.shape[-3]
    half = q.dtype in (torch.float16, torch.bfloat16)
    ok = {
        1: half and attn_mask is None and d <= 256 and d == v.shape[-1],  # flash (sm80+)
        2: (not gqa) and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
           and d % (8 if half else 4) == 0 and v.shape[-1] % (8 if half else 4) == 0,  # efficient
        0: True,  # math
        3: False,  # cudnn: after math in the default order, never reached
    }
    for b in torch._C._get_sdp_priority_order():
        if ok.get(b):
            return {1: "flash", 2: "efficient", 0: "math"}[b]
    return "math"


def routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    if not _EMU["installed"]:
        return _ORIG_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    q, k, v, m = query, key, value, attn_mask
    if torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        q, k, v = (t.to(dt) if t.dtype != dt else t for t in (q, k, v))
        if m is not None and m.is_floating_point() and m.dtype != dt:
            m = m.to(dt)
    backend = _choose_backend(q, k, v, m, enable_gqa)
    SDPA_LOG.append((backend, str(q.dtype), tuple(q.shape), tuple(k.shape)))
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    with torch.autocast("cpu", enabled=False):
        if backend == "flash":
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)
            return out[0]
        if backend == "efficient":
            if m is not None and m.dtype == torch.bool:
                m = torch.where(m, 0.0, float("-inf")).to(q.dtype)
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, m, need_grad, dropout_p, is_causal, scale=scale)
            return out[0]
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, m, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


# ---------------------------------------------------------------------------------------------
# 3. The tracker: MemTracker plus the phase of the peak and, on request, the storages alive at it.
# ---------------------------------------------------------------------------------------------

def _patched_track_params():
    # MemTracker installs gradient hooks on every parameter of a module, which fails on frozen
    # ones (LoRA's base weights): install them only where the parameter requires grad.
    import inspect
    import textwrap
    src = textwrap.dedent(inspect.getsource(MemTracker._track_module_params_and_buffers))
    src = src.replace("and install_grad_hooks", "and install_grad_hooks and param.requires_grad")
    ns = {}
    exec(compile(src, "<mem_tracker patched>", "exec"), _mt.__dict__, ns)
    return ns["_track_module_params_and_buffers"]


class Tracker(MemTracker):
    _track_module_params_and_buffers = _patched_track_params()

    def __init__(self, capture_at=None):
        super().__init__()
        self.phase = "init"
        self.peak_phase = "init"
        self.capture_at = capture_at  # total bytes at which to list the live storages
        self.captured = None
        self._func = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._func = func
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, reftype, t):
        if self.capture_at is None:
            return super()._track(reftype, t)
        new = [st for st in get_untyped_storages(t) if st not in self._WINFO]
        super()._track(reftype, t)
        mods = self._mod_tracker.parents
        mod = max(mods, key=len) if mods else ""
        for st in new:
            w = self._WINFO.get(st, (None, None))[0]
            if w is not None:
                w.mn_info = (self.phase, str(self._func).replace("aten.", ""), mod,
                             str(t.dtype).replace("torch.", ""), tuple(t.shape))

    def _update_peak_stats(self, peak_state):
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        for dev, v in self._peak_mem.items():
            if v > before.get(dev, 0) and dev.type == self.dev_type:
                self.peak_phase = self.phase
        if self.capture_at is not None and self.captured is None:
            for dev, snap in self._curr_mem_snap.items():
                if dev.type == self.dev_type and snap[_TOTAL_KEY] >= self.capture_at:
                    self.captured = (self.phase, [
                        (w.reftype.value, getattr(w, "mn_info", None), w.mem_consumed)
                        for w, _ in list(self._WINFO.values()) if w.device.type == self.dev_type
                    ])


# ---------------------------------------------------------------------------------------------
# 4. One measurement.
# ---------------------------------------------------------------------------------------------

def run(family, batch, seq, precision="fp32", attention="eager", optim="adamw",
        checkpointing=False, lora=0, overrides=None, fake=True, capture_at=None, steps=2):
    """Returns (peak bytes, {category: bytes at the peak}, peak phase, tracker)."""
    overrides = overrides or {}
    autocast_dtype, param_dtype, _ = PRECISIONS[precision]
    cfg, model_cls = make_config(family, overrides, attention)
    device = "cpu"
    if fake:
        install_cuda_emulation()
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    F.scaled_dot_product_attention = routed_sdpa
    SDPA_LOG.clear()
    try:
        with mode:
            # Built in the parameter dtype (model.to() cannot swap fake parameters).
            old_dtype = torch.get_default_dtype()
            torch.set_default_dtype(param_dtype)
            try:
                with torch.device(device):
                    torch.manual_seed(0)
                    model = model_cls(cfg)
            finally:
                torch.set_default_dtype(old_dtype)
            model.train()
            if checkpointing:
                kw = {"use_reentrant": False, "preserve_rng_state": not fake}
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
            if lora:
                import peft
                # peft moves each new adapter to the base layer's device and dtype; fake
                # parameters cannot be swapped by module.to(), and the adapters end in fp32 on
                # the same device either way (autocast_adapter_dtype casts them back): skip it
                peft.tuners.tuners_utils.BaseTunerLayer._move_adapter_to_device_of_base_layer = (
                    lambda self, adapter_name, device=None: None)
                targets = LORA_TARGETS.get(family, DEFAULT_LORA)[0]
                # SEQ_CLS would deep-copy the classifier into modules_to_save, which fake tensors
                # cannot do across modes; the classifier is unfrozen instead (same trainable set,
                # less peft's frozen copy of a 768x2 head)
                task = None if family == "bert" else "CAUSAL_LM"
                lcfg = peft.LoraConfig(r=lora, lora_alpha=2 * lora, lora_dropout=0.0,
                                       target_modules=targets, task_type=task)
                model = peft.get_peft_model(model, lcfg)
                if family == "bert":
                    for n, p in model.named_parameters():
                        if ".classifier." in n:
                            p.requires_grad_(True)
                if checkpointing:
                    model.enable_input_require_grads()
            params = [p for p in model.parameters() if p.requires_grad]
            if optim == "adamw":
                opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
            else:
                opt = torch.optim.SGD(params, lr=1e-3, foreach=True)
            tracker = Tracker(capture_at)
            tracker.dev_type = device
            tracker.track_external(model, opt)
            with tracker:
                for step in range(1, steps + 1):
                    tracker.reset_mod_stats()  # per-module stats only; the peak is kept
                    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
                    if family == "bert":
                        labels = torch.randint(0, 2, (batch,), device=device)
                    else:
                        labels = ids
                    tracker.phase = "forward%d" % step
                    ac = (torch.autocast(device, dtype=autocast_dtype) if autocast_dtype
                          else contextlib.nullcontext())
                    with ac:
                        out = model(input_ids=ids, labels=labels)
                    loss = out.loss
                    tracker.phase = "backward%d" % step
                    loss.backward()
                    tracker.phase = "step%d" % step
                    opt.step()
                    tracker.phase = "zero_grad%d" % step
                    opt.zero_grad(set_to_none=True)
                    del out, loss, ids, labels
    finally:
        F.scaled_dot_product_attention = _ORIG_SDPA
    snap = {d: s for d, s in tracker.get_tracker_snapshot("peak").items() if d.type == device}
    cats = next(iter(snap.values())) if snap else {}
    cats = {(k.value if hasattr(k, "value") else k): v for k, v in cats.items()}
    return cats.get(_TOTAL_KEY, 0), cats, tracker.peak_phase, tracker


def memanat_args(family, batch, seq, precision, attention, optim, checkpointing, lora, cfgpath):
    a = ["--config", cfgpath]
    if family == "bert":
        a += ["--head", "classification"]
    a += ["--batch", str(batch), "--seq", str(seq), "--precision", PRECISIONS[precision][2],
          "--optim", optim, "--attention", attention,
          "--checkpointing", "full" if checkpointing else "none"]
    if lora:
        a += ["--lora-rank", str(lora), "--lora-targets", LORA_TARGETS.get(family, DEFAULT_LORA)[1]]
    a += ["--torch", "2", "--gpu", "h100-80gb"]
    return " ".join(a)


CATS = ["Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other"]


def row(name, family, batch, seq, precision="fp32", attention="eager", optim="adamw",
        checkpointing=False, lora=0, overrides=None, write=True):
    overrides = overrides or {}
    peak, cats, phase, _ = run(family, batch, seq, precision, attention, optim, checkpointing,
                               lora, overrides)
    cfg, _ = make_config(family, overrides, attention)
    path = config_path(family, overrides)
    if write:
        write_config(cfg, path)
    args = memanat_args(family, batch, seq, precision, attention, optim, checkpointing, lora, path)
    backends = sorted(set(b for b, *_ in SDPA_LOG)) if attention == "sdpa" else ["eager"]
    return "\t".join([name, str(peak)] + [str(cats.get(c, 0)) for c in CATS]
                     + [phase, ",".join(backends), args])


# The table: (name, family, batch, seq, precision, attention, optim, checkpointing, lora, overrides)
TABLE = [
    ("gpt2-fp32-eager-b4s512", "gpt2", 4, 512, "fp32", "eager", "adamw", False, 0),
    ("gpt2-fp32-sdpa-b4s512", "gpt2", 4, 512, "fp32", "sdpa", "adamw", False, 0),
    ("gpt2-bf16-eager-b4s512", "gpt2", 4, 512, "bf16", "eager", "adamw", False, 0),
    ("gpt2-bf16-sdpa-b4s512", "gpt2", 4, 512, "bf16", "sdpa", "adamw", False, 0),
    ("gpt2-fp16-sdpa-b8s1024", "gpt2", 8, 1024, "fp16", "sdpa", "adamw", False, 0),
    ("gpt2-bf16pure-sdpa-b4s1024", "gpt2", 4, 1024, "bf16-pure", "sdpa", "adamw", False, 0),
    ("gpt2-bf16-sdpa-gc-b8s1024", "gpt2", 8, 1024, "bf16", "sdpa", "adamw", True, 0),
    ("gpt2-fp32-eager-sgd-b2s256", "gpt2", 2, 256, "fp32", "eager", "sgd", False, 0),
    ("gpt2-bf16-sdpa-lora8-b4s512", "gpt2", 4, 512, "bf16", "sdpa", "adamw", False, 8),
    ("llama-fp32-eager-b2s512", "llama", 2, 512, "fp32", "eager", "adamw", False, 0),
    ("llama-fp32-sdpa-b2s512", "llama", 2, 512, "fp32", "sdpa", "adamw", False, 0),
    ("llama-bf16-sdpa-b4s1024", "llama", 4, 1024, "bf16", "sdpa", "adamw", False, 0),
    ("llama-bf16-eager-b4s1024", "llama", 4, 1024, "bf16", "eager", "adamw", False, 0),
    ("llama-fp16-sdpa-b2s2048", "llama", 2, 2048, "fp16", "sdpa", "adamw", False, 0),
    ("llama-bf16pure-sdpa-b4s1024", "llama", 4, 1024, "bf16-pure", "sdpa", "adamw", False, 0),
    ("llama-bf16pure-sdpa-sgd-b4s1024", "llama", 4, 1024, "bf16-pure", "sdpa", "sgd", False, 0),
    ("llama-bf16-sdpa-gc-b8s2048", "llama", 8, 2048, "bf16", "sdpa", "adamw", True, 0),
    ("llama-bf16-sdpa-lora16-b4s1024", "llama", 4, 1024, "bf16", "sdpa", "adamw", False, 16),
    ("llama-bf16pure-sdpa-lora16-gc-b4s2048", "llama", 4, 2048, "bf16-pure", "sdpa", "adamw", True, 16),
    ("mistral-bf16-sdpa-b4s1024", "mistral", 4, 1024, "bf16", "sdpa", "adamw", False, 0),
    ("mistral-fp32-sdpa-b2s512", "mistral", 2, 512, "fp32", "sdpa", "adamw", False, 0),
    ("mistral-fp32-eager-b2s512", "mistral", 2, 512, "fp32", "eager", "adamw", False, 0),
    ("mistral-bf16pure-eager-b2s1024", "mistral", 2, 1024, "bf16-pure", "eager", "adamw", False, 0),
    ("mistral-fp16-sdpa-gc-b4s2048", "mistral", 4, 2048, "fp16", "sdpa", "adamw", True, 0),
    ("mistral-bf16-sdpa-lora8-b2s2048", "mistral", 2, 2048, "bf16", "sdpa", "adamw", False, 8),
    ("qwen2-bf16-sdpa-b4s1024", "qwen2", 4, 1024, "bf16", "sdpa", "adamw", False, 0),
    ("qwen2-fp32-eager-b2s512", "qwen2", 2, 512, "fp32", "eager", "adamw", False, 0),
    ("qwen2-bf16pure-sdpa-b8s512", "qwen2", 8, 512, "bf16-pure", "sdpa", "adamw", False, 0),
    ("qwen2-bf16-sdpa-gc-b8s1024", "qwen2", 8, 1024, "bf16", "sdpa", "adamw", True, 0),
    ("qwen2-bf16-sdpa-lora8-b4s1024", "qwen2", 4, 1024, "bf16", "sdpa", "adamw", False, 8),
    ("qwen2-fp16-eager-sgd-b2s1024", "qwen2", 2, 1024, "fp16", "eager", "sgd", False, 0),
    ("bert-fp32-eager-b8s512", "bert", 8, 512, "fp32", "eager", "adamw", False, 0),
    ("bert-fp32-sdpa-b8s512", "bert", 8, 512, "fp32", "sdpa", "adamw", False, 0),
    ("bert-fp16-eager-b8s512", "bert", 8, 512, "fp16", "eager", "adamw", False, 0),
    ("bert-bf16-sdpa-b16s256", "bert", 16, 256, "bf16", "sdpa", "adamw", False, 0),
    ("bert-fp32-eager-gc-b8s512", "bert", 8, 512, "fp32", "eager", "adamw", True, 0),
    ("bert-bf16-sdpa-lora8-b16s512", "bert", 16, 512, "bf16", "sdpa", "adamw", False, 8),
    ("bert-fp32-eager-sgd-b4s128", "bert", 4, 128, "fp32", "eager", "sgd", False, 0),
    ("gemma-bf16-sdpa-b2s1024", "gemma", 2, 1024, "bf16", "sdpa", "adamw", False, 0),
    ("gemma-fp32-eager-b1s512", "gemma", 1, 512, "fp32", "eager", "adamw", False, 0),
    ("gemma-bf16pure-sdpa-gc-b4s2048", "gemma", 4, 2048, "bf16-pure", "sdpa", "adamw", True, 0),
    ("gemma-bf16-sdpa-lora8-b2s1024", "gemma", 2, 1024, "bf16", "sdpa", "adamw", False, 8),
    ("phi3-bf16-sdpa-b4s1024", "phi3", 4, 1024, "bf16", "sdpa", "adamw", False, 0),
    ("phi3-fp16-eager-b2s512", "phi3", 2, 512, "fp16", "eager", "adamw", False, 0),
    ("phi3-bf16pure-sdpa-lora16-b4s1024", "phi3", 4, 1024, "bf16-pure", "sdpa", "adamw", False, 16),
]

HEADER = """# torch2 ground-truth table: peak allocated bytes of two training steps of the real
# transformers/peft modelling code, measured by tools/torchcheck.py without a GPU: FakeTensorMode
# + torch.distributed._tools.mem_tracker.MemTracker, storages rounded to 512 B, CUDA behaviour
# put back on fake cpu tensors (CUDA autocast op policy, native_dropout, SDPA backend routing as
# select_sdp_backend on sm80/sm90); see tools/README.md.
# Not counted (no dispatcher-level tool sees them): CUDA context, cuBLAS/cuDNN workspaces,
# kernels' internal scratch, allocator fragmentation and reserved memory.
# Script: {version}; torch {torch}; transformers {tf}; peft {peft}; python {py}.
# Regenerate: python tools/torchcheck.py --table --jobs 2 > test/validation/torch2.tsv
# Step: forward with labels (autocast for bf16/fp16), backward, optimizer.step() (foreach=True),
# zero_grad(set_to_none=True), outputs dropped after zero_grad; 2 steps; LoRA: peft,
# lora_dropout 0, alpha 2r, adapters fp32 (peft default autocast_adapter_dtype); gradient
# checkpointing: HF, use_reentrant=False. Model sizes: see FAMILIES in the script.
# Columns: name; peak = measured peak allocated bytes; then the live bytes at that peak per
# MemTracker category (param, buffer, grad, act, temp = backward temporaries and activation
# gradients, opt = optimizer state and the step's temporaries, other); peak_phase (forwardN,
# backwardN, stepN, zero_gradN of step N); sdpa backends used (eager = no SDPA); args = the
# memanat estimate options describing the same setup (paths relative to the repository root).
# name\tpeak\tparam\tbuffer\tgrad\tact\ttemp\topt\tother\tpeak_phase\tattn_backend\targs"""


def table(names=None, jobs=1):
    """All rows with the header (names empty), or the named rows only; jobs > 1 runs one
    process per row, jobs at a time, and prints the rows in table order."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor
    if names:
        for t in TABLE:
            if t[0] in names:
                print(row(*t))
                sys.stdout.flush()
        return
    import peft
    print(HEADER.format(version=VERSION, torch=torch.__version__, tf=transformers.__version__,
                        peft=peft.__version__, py=sys.version.split()[0]))
    sys.stdout.flush()

    def one(t):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--table", t[0]],
                           cwd=REPO, capture_output=True, text=True)
        out = [ln for ln in r.stdout.splitlines() if ln.startswith(t[0] + "\t")]
        if r.returncode != 0 or not out:
            sys.stderr.write("%s failed:\n%s\n" % (t[0], r.stderr[-3000:]))
            return None
        return out[0]
    with ThreadPoolExecutor(max(1, jobs)) as ex:
        for line in ex.map(one, TABLE):
            if line:
                print(line)
                sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# 5. --explain: the storages alive at the peak, grouped.
# ---------------------------------------------------------------------------------------------

def explain(family, batch, seq, precision, attention, optim, checkpointing, lora, overrides,
            top=40):
    peak, cats, phase, _ = run(family, batch, seq, precision, attention, optim, checkpointing,
                               lora, overrides)
    _, _, _, tr = run(family, batch, seq, precision, attention, optim, checkpointing, lora,
                      overrides, capture_at=peak)
    cphase, live = tr.captured
    print("# peak %d bytes (%.1f MiB) in %s; categories: %s" % (
        peak, peak / 2**20, phase, ", ".join("%s %.1f MiB" % (k, v / 2**20)
                                             for k, v in cats.items() if v)))
    groups = {}
    for cat, info, b in live:
        if info is None:
            key = (cat, "(created before tracking)", "", "", "")
        else:
            ph, op, mod, dt, shape = info
            # strip layer indices so that every layer's copy falls into one group
            modg = ".".join("N" if p.isdigit() else p for p in mod.split("."))
            key = (cat, ph, op, modg, dt)
        g = groups.setdefault(key, [0, 0, None])
        g[0] += 1
        g[1] += b
        if info is not None:
            g[2] = info[4]
    print("# category\tphase\top\tmodule(N = any layer)\tdtype\tcount\tbytes\tMiB\texample shape")
    for key, (n, b, shape) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        print("\t".join(list(key) + [str(n), str(b), "%.2f" % (b / 2**20), str(shape)]))


# ---------------------------------------------------------------------------------------------
# 6. --validate: the method on the CPU with real tensors, against the profiler's allocator events.
# ---------------------------------------------------------------------------------------------

def validate():
    cases = [
        ("gpt2 2L h256 fp32 eager", "gpt2", dict(n_layer=2, n_embd=256, n_head=4, vocab_size=5000),
         2, 128, "fp32", "eager", "adamw", False, 0),
        ("llama 2L h256 fp32 sdpa sgd", "llama", dict(num_hidden_layers=2, hidden_size=256,
         intermediate_size=704, num_attention_heads=4, num_key_value_heads=4, vocab_size=4000),
         2, 128, "fp32", "sdpa", "sgd", False, 0),
        ("qwen2 2L h256 bf16-pure sdpa gc", "qwen2", dict(num_hidden_layers=2, hidden_size=256,
         intermediate_size=704, num_attention_heads=4, num_key_value_heads=2, vocab_size=6000),
         2, 128, "bf16-pure", "sdpa", "adamw", True, 0),
        ("bert 2L h256 fp32 eager lora8", "bert", dict(num_hidden_layers=2, hidden_size=256,
         intermediate_size=1024, num_attention_heads=4, vocab_size=5000, num_labels=2),
         4, 128, "fp32", "eager", "adamw", False, 8),
    ]
    from torch.profiler import ProfilerActivity, profile
    print("case\tmemtracker_peak\tprofiler_peak\tdiff_bytes\tdiff_%")
    import gc as pygc
    for name, fam, ov, b, s, prec, att, opt, gc, lora in cases:
        # the previous case's objects must be gone before the count starts: a storage allocated
        # before the profile and freed inside it would lower the profiler's running sum
        pygc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            peak, cats, phase, _ = run(fam, b, s, prec, att, opt, gc, lora, ov, fake=False)
        # Allocator events in time order; the bytes alive before the model was built are 0 here,
        # because the model, optimizer and data are all created inside the profiled region.
        evs = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        evs.sort(key=lambda e: e.start_ns())
        cur = best = 0
        for e in evs:
            cur += e.nbytes()
            best = max(best, cur)
        # MemTracker only counts from the moment it is entered, and the model exists before:
        # its peak includes the model's storages (tracked by track_external), so both counts
        # cover the same tensors.
        print("%s\t%d\t%d\t%d\t%.3f" % (name, peak, best, best - peak, 100.0 * (best - peak) / peak))


# ---------------------------------------------------------------------------------------------
# 7. --check-emulation: forward only, real CUDA autocast on fake "cuda" tensors (forward works
#    there; only backward needs the driver) against the emulation on fake cpu tensors.
# ---------------------------------------------------------------------------------------------

def _forward_peak(family, batch, seq, precision, device):
    autocast_dtype, param_dtype, _ = PRECISIONS[precision]
    cfg, model_cls = make_config(family, {}, "eager")
    import transformers.masking_utils as mu
    mu.find_packed_sequence_indices = lambda position_ids: None
    with FakeTensorMode():
        torch.set_default_dtype(param_dtype)
        with torch.device(device):
            model = model_cls(cfg)
        torch.set_default_dtype(torch.float32)
        model.train()
        tr = Tracker()
        tr.dev_type = device
        tr.track_external(model)
        with tr:
            ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
            labels = torch.randint(0, 2, (batch,), device=device) if family == "bert" else ids
            ac = (torch.autocast(device, dtype=autocast_dtype) if autocast_dtype
                  else contextlib.nullcontext())
            with ac:
                out = model(input_ids=ids, labels=labels)
            cur = tr.get_tracker_snapshot("current")
        peak = tr.get_tracker_snapshot("peak")
    pick = lambda snap: next(v for d, v in snap.items() if d.type == device)[_TOTAL_KEY]
    del out
    return pick(peak), pick(cur)


def check_emulation():
    cases = [("gpt2", 4, 512, "bf16"), ("gpt2", 4, 512, "fp16"), ("llama", 2, 1024, "bf16"),
             ("qwen2", 2, 512, "fp16"), ("bert", 8, 256, "bf16"), ("gemma", 1, 512, "bf16"),
             ("phi3", 2, 512, "fp16"), ("mistral", 2, 512, "bf16")]
    import torch.amp.autocast_mode as am
    am.torch.cuda.amp.common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    res = [(c, _forward_peak(*c, "cuda")) for c in cases]  # before the emulation is installed
    install_cuda_emulation()
    print("case\tcuda_fwd_peak\temulated_fwd_peak\tcuda_after_fwd\temulated_after_fwd\tdiff_%")
    for c, (pc, cc) in res:
        pe, ce = _forward_peak(*c, "cpu")
        print("%s b%d s%d %s\t%d\t%d\t%d\t%d\t%.3f" % (c[0], c[1], c[2], c[3], pc, pe, cc, ce,
                                                        100.0 * (pe - pc) / pc))


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--family", choices=sorted(FAMILIES), default="gpt2")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. --set num_hidden_layers=4 (int/float/str)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    ap.add_argument("--attention", choices=["eager", "sdpa"], default="eager")
    ap.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK")
    ap.add_argument("--explain", action="store_true", help="list the storages alive at the peak")
    ap.add_argument("--no-write", action="store_true", help="do not write the config.json")
    ap.add_argument("--table", nargs="*", metavar="NAME", help="print the table rows (all or NAMEs)")
    ap.add_argument("--jobs", type=int, default=1, help="--table: rows run in parallel")
    ap.add_argument("--check-emulation", action="store_true",
                    help="forward only: real CUDA autocast on fake cuda vs the emulation")
    ap.add_argument("--validate", action="store_true", help="MemTracker vs profiler, CPU, real")
    a = ap.parse_args()
    if a.validate:
        return validate()
    if a.check_emulation:
        return check_emulation()
    if a.table is not None:
        return table(a.table, a.jobs)
    ov = {}
    for kv in a.set:
        k, v = kv.split("=", 1)
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        ov[k] = v
    if a.explain:
        return explain(a.family, a.batch, a.seq, a.precision, a.attention, a.optim,
                       a.checkpointing, a.lora, ov)
    print(row("custom", a.family, a.batch, a.seq, a.precision, a.attention, a.optim,
              a.checkpointing, a.lora, ov, write=not a.no_write))


if __name__ == "__main__":
    main()
