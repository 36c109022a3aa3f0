// memanat_api: memanat.h behind one text-in, text-out entry point, for the places that cannot
// include a C header: the Python package (python/, a CPython extension) and the web page (web/,
// WebAssembly). Both send a JSON object naming the settings the way the CLI's flags do
// (batch, seq, precision, lora_rank, ...: the flag without its dashes, '-' as '_') and read back
// a JSON object with the CLI's --json keys, so a number means the same in all three places.
//
//   char *out = NULL;  size_t n = 0;
//   const char *req = "{\"model\": \"gpt2\", \"batch\": 4, \"seq\": 1024}";
//   int rc = mn_api_call("estimate", req, strlen(req), &out, &n);
//   // rc == MN_OK: out holds {"weights": ..., "device_used": ..., "fits": true, ...}
//   // rc < 0 (an mn_result): out holds one line naming the problem
//   mn_api_free(out);
//
// Operations and their requests (every key optional unless said; null = not given):
//   estimate  model | config (a config.json path or model folder) | config_json (its text) |
//             params; trainable_params, head, batch, seq, accum, precision, optim,
//             checkpointing, attention, lora_rank, lora_targets, quant, bnb_version,
//             quant_head, framework, torch, zero, gpus, offload, zero_grad, gpu, context,
//             capacity, alloc_conf, infer, prompt, new_tokens, beams; seq_lengths (a lengths
//             file or "MIN:MAX:MEAN") or seq_lengths_text (a lengths file's text), steps, seed,
//             percentile; safetensors ([{name, size, header_base64}]: shard headers sent
//             with config_json, counted as a model folder's) and safetensors_index (the
//             index's text); and the outputs wanted: parts (true), svg (true: the timeline of the
//             predicted step, the picture `memanat estimate --svg` writes)
//             Where pointers have 32 bits (wasm32) a step needing more than about 1 TiB of
//             segments cannot be replayed: when its allocated peak alone exceeds the device, the
//             answer is the estimate without the replay with "replayed": false (peak_allocated,
//             peak_reserved and device_used then lower bounds, no svg); otherwise an error.
//   fit       the same settings; the answer of `memanat fit --json`
//   replay    device_traces (a torch.cuda.memory._snapshot() device_traces array: entries with
//             action, addr, size, stream, and optionally category), alloc_conf, capacity,
//             svg (true), title; a whole snapshot may be sent (its other members are not
//             read); the answer of `memanat replay --json`
//   models    {}: the model presets and the GPU table
//   options   {}: the setting names estimate and fit accept
// Counts take a JSON integer or the CLI's text ("7e9", "350M"); sizes an integer of bytes or
// text ("16GiB", "1343MiB"). No state survives a call; calls may run in parallel.
#ifndef MEMANAT_API_H
#define MEMANAT_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Returns 0 (MN_OK) with the answer in *out, or a negative mn_result with a one-line message in
// *out. *out is allocated (NUL-terminated, *out_len bytes before the NUL) and released with
// mn_api_free; it is NULL only when even the message could not be allocated.
int mn_api_call(const char *op, const char *request, size_t len, char **out, size_t *out_len);
void mn_api_free(char *p);

#ifdef __cplusplus
}
#endif

#endif
