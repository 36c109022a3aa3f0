#!/usr/bin/env python3
# Writes the tiny model folders used by test/test_hfconfig.c (run from test/data/hf/).
# safetensors layout: 8-byte little-endian header length, JSON header, data (zeros here).
import json, os, struct

SIZES = {"F32": 4, "BF16": 2, "F16": 2}

def write_st(path, tensors, pad=0):
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + bytes(off + pad))

def llama():
    os.makedirs("tiny-llama", exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 128,
           "tie_word_embeddings": False, "torch_dtype": "float32"}
    json.dump(cfg, open("tiny-llama/config.json", "w"), indent=2)
    layer = lambda i: [
        (f"model.layers.{i}.input_layernorm.weight", "F32", [16]),
        (f"model.layers.{i}.self_attn.q_proj.weight", "BF16", [16, 16]),
        (f"model.layers.{i}.self_attn.k_proj.weight", "BF16", [8, 16]),
        (f"model.layers.{i}.self_attn.v_proj.weight", "BF16", [8, 16]),
        (f"model.layers.{i}.self_attn.o_proj.weight", "BF16", [16, 16]),
        (f"model.layers.{i}.post_attention_layernorm.weight", "F32", [16]),
        (f"model.layers.{i}.mlp.gate_proj.weight", "BF16", [32, 16]),
        (f"model.layers.{i}.mlp.up_proj.weight", "BF16", [32, 16]),
        (f"model.layers.{i}.mlp.down_proj.weight", "BF16", [16, 32])]
    s1 = [("model.embed_tokens.weight", "BF16", [64, 16])] + layer(0)
    s2 = layer(1) + [("model.norm.weight", "F32", [16]), ("lm_head.weight", "BF16", [64, 16])]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    write_st("tiny-llama/" + names[0], s1)
    write_st("tiny-llama/" + names[1], s2)
    wm = {t[0]: names[0] for t in s1}
    wm.update({t[0]: names[1] for t in s2})
    json.dump({"metadata": {"total_size": 0}, "weight_map": wm},
              open("tiny-llama/model.safetensors.index.json", "w"), indent=2)

def gpt2(folder="tiny-gpt2", quant=False):
    os.makedirs(folder, exist_ok=True)
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8, "n_layer": 1,
           "n_head": 2, "n_positions": 16, "vocab_size": 32}
    if quant:  # packed weights: the safetensors element count is not the parameter count
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    json.dump(cfg, open(folder + "/config.json", "w"), indent=2)
    t = [("wte.weight", "F32", [32, 8]), ("wpe.weight", "F32", [16, 8]),
         ("h.0.ln_1.weight", "F32", [8]), ("h.0.ln_1.bias", "F32", [8]),
         ("h.0.attn.bias", "F32", [1, 1, 16, 16]),
         ("h.0.attn.c_attn.weight", "F32", [8, 24]), ("h.0.attn.c_attn.bias", "F32", [24]),
         ("h.0.attn.c_proj.weight", "F32", [8, 8]), ("h.0.attn.c_proj.bias", "F32", [8]),
         ("h.0.ln_2.weight", "F32", [8]), ("h.0.ln_2.bias", "F32", [8]),
         ("h.0.mlp.c_fc.weight", "F32", [8, 32]), ("h.0.mlp.c_fc.bias", "F32", [32]),
         ("h.0.mlp.c_proj.weight", "F32", [32, 8]), ("h.0.mlp.c_proj.bias", "F32", [8]),
         ("ln_f.weight", "F32", [8]), ("ln_f.bias", "F32", [8])]
    write_st(folder + "/model.safetensors", t)

def bad():
    # data section one byte longer than the tensors: the reference reader rejects it
    os.makedirs("bad-shard", exist_ok=True)
    json.dump({"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "vocab_size": 32},
              open("bad-shard/config.json", "w"), indent=2)
    write_st("bad-shard/model.safetensors", [("wte.weight", "F32", [32, 8])], pad=1)

def missing():
    # the index names a shard that is not there
    os.makedirs("missing-shard", exist_ok=True)
    json.dump({"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "vocab_size": 32},
              open("missing-shard/config.json", "w"), indent=2)
    json.dump({"metadata": {}, "weight_map": {"wte.weight": "model-00001-of-00001.safetensors"}},
              open("missing-shard/model.safetensors.index.json", "w"), indent=2)

def config_only():
    # a folder without weights: the shape gives the parameter count
    os.makedirs("config-only", exist_ok=True)
    json.dump({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
               "vocab_size": 100}, open("config-only/config.json", "w"), indent=2)

llama()
config_only()
gpt2()
gpt2("tiny-quant", quant=True)
bad()
missing()
