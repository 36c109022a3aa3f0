// >>ops -----------------------------------------------------------------------------------------
//
// CPU reference ops, forward and backward, on caller-owned fp32 host arrays with fp32 (or double)
// accumulation. They are the ground truth for the CUDA kernels and the compute of the CPU trainer.
// The layout follows llm.c's train_gpt2.c: row-major, the last dimension the fastest.
//
// Shapes used in the comments below:
//   B batch, T sequence length, C channels, OC output channels, NH heads, hs = C / NH head size,
//   V vocabulary, N = B * T rows (any number of rows for the row-wise ops), n elements.
//
// Conventions:
//   - Every backward ACCUMULATES (+=) into its gradient buffers, as llm.c does, so gradients of a
//     tensor used twice add up and gradient accumulation over micro-batches needs no extra pass.
//     Zero the gradient buffers before the first backward.
//   - Output buffers do not alias inputs unless a comment says so.
//   - Ops that only compute on caller buffers return void; ops that validate data (token ids,
//     targets, probabilities) return mn_result and write nothing when they fail.
//   - With OpenMP (-fopenmp) the heavy loops run in parallel; threads own disjoint outputs and
//     every sum runs in a fixed order, so results do not depend on the thread count. Every op
//     also builds and runs without OpenMP. No op allocates memory; matmul and attention keep
//     their packed tiles on the stack (about 160 KiB per thread).
//   - exp (softmax, attention, cross-entropy, GELU, SiLU) is computed inline to about 1 ulp so the
//     loops vectorize; results below ~1e-38 may flush to zero.

// Matmul: out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC], cache-blocked and register-tiled.
// pre_gelu: [N,OC] or NULL. Non-NULL selects the fused GELU (tanh) epilogue: pre_gelu receives
//   inp @ weight^T + bias and out = gelu(pre_gelu). bias may be NULL.
MNDEF void mn_matmul_forward(float *out, float *pre_gelu, const float *inp, const float *weight,
                             const float *bias, int N, int C, int OC);
// dinp[N,C] += dpre @ weight;  dweight[OC,C] += dpre^T @ inp;  dbias[OC] += sum_n dpre[n,:],
// where dpre = dout, or dout * gelu'(pre_gelu) when pre_gelu is non-NULL. In that case dout [N,OC]
// is overwritten in place with dpre (as cuBLASLt's DGELU epilogue does). dinp, dweight and dbias
// may each be NULL to skip that gradient.
MNDEF void mn_matmul_backward(float *dinp, float *dweight, float *dbias, float *dout,
                              const float *inp, const float *weight, const float *pre_gelu,
                              int N, int C, int OC);

// LayerNorm over the last dimension (Ba, Kiros & Hinton 2016), biased variance, eps e.g. 1e-5.
// out[N,C], mean[N] and rstd[N] (saved for backward, may be NULL), inp[N,C], weight[C],
// bias[C] or NULL.
MNDEF void mn_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                const float *weight, const float *bias, int N, int C, float eps);
// dinp[N,C] +=, dweight[C] +=, dbias[C] += (or NULL); dout[N,C], inp[N,C], weight[C],
// mean[N] and rstd[N] from the forward.
MNDEF void mn_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                 const float *inp, const float *weight, const float *mean,
                                 const float *rstd, int N, int C);

// RMSNorm (Zhang & Sennrich 2019): out = inp * rstd * weight, rstd = 1/sqrt(mean(inp^2) + eps).
// out[N,C], rstd[N] (saved for backward, may be NULL), inp[N,C], weight[C].
MNDEF void mn_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                              int N, int C, float eps);
// dinp[N,C] +=, dweight[C] +=; dout[N,C], inp[N,C], weight[C], rstd[N] from the forward.
MNDEF void mn_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                               const float *weight, const float *rstd, int N, int C);

// Softmax over rows of length L: out[n,:] = softmax(scale * inp[n,:]). With causal non-zero the
// rows form square [L,L] blocks (row n is query position t = n % L) and columns j > t are masked:
// their probability is exactly 0. out[N,L], inp[N,L].
MNDEF void mn_softmax_forward(float *out, const float *inp, int N, int L, float scale, int causal);
// dinp[N,L] += scale * out * (dout - sum_j out_j * dout_j); dout[N,L], out[N,L] from the forward.
MNDEF void mn_softmax_backward(float *dinp, const float *dout, const float *out, int N, int L,
                               float scale, int causal);

// Multi-head scaled dot-product attention (Vaswani et al. 2017) over a fused qkv buffer
// [B,T,3C]: q = qkv[..., 0:C], k = qkv[..., C:2C], v = qkv[..., 2C:3C], head h uses channels
// h*hs .. h*hs+hs-1 of each; scores are scaled by 1/sqrt(hs); causal non-zero masks keys after
// the query. out[B,T,C]. att [B,NH,T,T] receives the probabilities (masked entries 0) for the
// backward, or is NULL to keep nothing: the backward then recomputes them (no O(T^2) activation,
// like FlashAttention; the same gradients, bit for bit). Either way the work is tiled and needs
// no T x T scratch.
MNDEF void mn_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C,
                                int NH, int causal);
// dqkv[B,T,3C] +=; dout[B,T,C], qkv[B,T,3C], att [B,NH,T,T] from the forward or NULL.
MNDEF void mn_attention_backward(float *dqkv, const float *dout, const float *qkv,
                                 const float *att, int B, int T, int C, int NH, int causal);

// GELU, tanh approximation (Hendrycks & Gimpel 2016; GPT-2, llm.c, cuBLASLt's GELU epilogue):
// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). out[n], inp[n]; out may equal inp.
MNDEF void mn_gelu_forward(float *out, const float *inp, size_t n);
// dinp[n] += dout * gelu'(inp).
MNDEF void mn_gelu_backward(float *dinp, const float *dout, const float *inp, size_t n);
// Exact GELU (Hendrycks & Gimpel 2016; torch.nn.GELU() default): out = 0.5 x (1 + erf(x/sqrt 2)).
MNDEF void mn_gelu_erf_forward(float *out, const float *inp, size_t n);
MNDEF void mn_gelu_erf_backward(float *dinp, const float *dout, const float *inp, size_t n);

// SiLU / swish (Elfwing, Uchibe & Doya 2018; Ramachandran et al. 2017): out = x * sigmoid(x).
// out[n], inp[n]; out may equal inp. Backward: dinp[n] += dout * silu'(inp).
MNDEF void mn_silu_forward(float *out, const float *inp, size_t n);
MNDEF void mn_silu_backward(float *dinp, const float *dout, const float *inp, size_t n);
// SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): out = silu(gate) * up.
// out[n], gate[n], up[n]. Backward: dgate[n] +=, dup[n] += (either may be NULL).
MNDEF void mn_swiglu_forward(float *out, const float *gate, const float *up, size_t n);
MNDEF void mn_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                              const float *up, size_t n);

// Residual add: out[n] = a[n] + b[n] (out may equal a or b). Backward: da[n] += dout,
// db[n] += dout (either may be NULL).
MNDEF void mn_residual_forward(float *out, const float *a, const float *b, size_t n);
MNDEF void mn_residual_backward(float *da, float *db, const float *dout, size_t n);

// Embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]. out[B,T,C], tokens[B,T] in [0,V),
// wte[V,C], wpe[T,C] or NULL (no position embedding). MN_ERR_INVALID_ARG for a token outside
// [0,V) (nothing written).
MNDEF mn_result mn_embedding_forward(float *out, const int *tokens, const float *wte,
                                     const float *wpe, int B, int T, int C, int V);
// Scatter-add: dwte[tokens[b,t],:] += dout[b,t,:], dwpe[t,:] += dout[b,t,:] (either may be NULL).
MNDEF mn_result mn_embedding_backward(float *dwte, float *dwpe, const float *dout,
                                      const int *tokens, int B, int T, int C, int V);

// Cross-entropy fused with softmax: losses[n] = -log softmax(logits[n,:])[targets[n]].
// losses[N], probs[N,V] (kept for the backward, or NULL), logits[N,V], targets[N].
// A negative target marks an ignored row (loss 0, no gradient), like PyTorch's ignore_index;
// a target >= V is MN_ERR_INVALID_ARG (nothing written).
MNDEF mn_result mn_crossentropy_forward(float *losses, float *probs, const float *logits,
                                        const int *targets, int N, int V);
// dlogits[N,V] += (probs - onehot(targets)) * dlosses[n]; dlosses[N] (e.g. 1/N for a mean loss).
// probs [N,V] from the forward, or NULL to recompute them from logits[N,V] (then logits is
// read; otherwise it may be NULL).
MNDEF mn_result mn_crossentropy_backward(float *dlogits, const float *dlosses, const float *probs,
                                         const float *logits, const int *targets, int N, int V);

// Dropout (Srivastava et al. 2014), inverted: out = inp * keep / (1 - p), keep with probability
// 1 - p. The decision for element i is a function of (seed, offset + i) only, drawn from the
// counter-based Philox-4x32-10 generator (Salmon et al. 2011, Random123; the generator of
// PyTorch's CUDA dropout): no mask has to be stored, the backward and a recompute agree with the
// forward. Split a tensor across calls by advancing offset by the elements already done.
// p in [0,1], p = 1 drops everything; anything else is MN_ERR_INVALID_ARG.
// out[n] (may equal inp), mask[n] or NULL: receives 1 (kept) or 0 (dropped), inp[n].
MNDEF mn_result mn_dropout_forward(float *out, uint8_t *mask, const float *inp, size_t n,
                                   float p, uint64_t seed, uint64_t offset);
// dinp[n] += dout * keep / (1 - p); mask [n] from the forward or NULL to regenerate it.
MNDEF mn_result mn_dropout_backward(float *dinp, const float *dout, const uint8_t *mask, size_t n,
                                    float p, uint64_t seed, uint64_t offset);
// The keep mask alone: mask[n] = 1 where element offset + i is kept.
MNDEF mn_result mn_dropout_mask(uint8_t *mask, size_t n, float p, uint64_t seed, uint64_t offset);
// Philox-4x32-10 block: four 32-bit words for a 128-bit counter and a 64-bit key.
MNDEF void mn_philox4x32(const uint32_t ctr[4], uint64_t key, uint32_t out[4]);
