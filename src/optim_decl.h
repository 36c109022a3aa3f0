// >>optim ---------------------------------------------------------------------------------------
//
// Optimizers on host arrays, one state struct per parameter tensor (init / step / free), the state
// sizes the estimator uses, gradient clipping by global norm, dynamic loss scaling, and fp16/bf16
// conversion. The state an optimizer allocates is exactly what its *_state_bytes function reports
// for the same shape and settings, so predicted and real state sizes are one number.
//
// Conventions shared by every optimizer:
//   - param [n] is fp32 and updated in place; grad [n] is fp32 and read only. With a 16-bit model
//     (params.dtype MN_FP16 or MN_BF16) param is the fp32 master copy and step also rewrites the
//     16-bit tensor param16 [n] from it, rounding to nearest even.
//   - Hyperparameters: zero selects the default written beside the field. A field marked [z]
//     accepts MN_OPTIM_ZERO to request a real zero where zero itself means "default". After init,
//     s->params holds the resolved values; s->params.lr may be changed between steps (schedules).
//   - s->step counts the steps taken; the bias corrections use t = s->step after the increment.
//   - State memory comes from the allocator given to init (NULL = MN_MALLOC/MN_FREE) in a single
//     block of s->state_bytes bytes; free releases it and zeroes the struct.

// Value for a [z] field: "exactly zero", where 0 selects the default.
#define MN_OPTIM_ZERO (-1.0f)

typedef struct mn_optim_desc {
    mn_optim kind;            // 0 = adamw
    int adafactor_beta1;      // Adafactor keeps a first moment (beta1 set), 0 = no (transformers)
    uint32_t block_size;      // 8-bit: elements per absmax block, 0 = 256 (bitsandbytes blockwise)
    uint64_t min_8bit_size;   // 8-bit: tensors with fewer elements keep 32-bit state, 0 = 4096
    int amsgrad;              // AdamW keeps the running max of v (one more fp32 array), 0 = no
} mn_optim_desc;

// Bytes of optimizer state kept for one parameter tensor of the given shape (dims[0..ndim-1],
// ndim 1..8, the last dimension the fastest), for 32-bit master parameters.
MNDEF mn_result mn_optim_state_bytes(const mn_optim_desc *d, const uint64_t *dims, uint32_t ndim,
                                     uint64_t *out);
MNDEF mn_result mn_sgd_state_bytes(const uint64_t *dims, uint32_t ndim, int momentum,
                                   uint64_t *out);
MNDEF mn_result mn_adamw_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out);
MNDEF mn_result mn_adamw8bit_state_bytes(const uint64_t *dims, uint32_t ndim, uint32_t block_size,
                                         uint64_t min_8bit_size, uint64_t *out);
MNDEF mn_result mn_adafactor_state_bytes(const uint64_t *dims, uint32_t ndim, int beta1,
                                         uint64_t *out);
MNDEF mn_result mn_lion_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out);

// --- SGD (torch.optim.SGD) ---------------------------------------------------------------------
typedef struct mn_sgd_params {
    float lr;             // 0 = 1e-3 [z]
    float momentum;       // 0 = none: plain SGD, no state [z]
    float dampening;      // 0 = 0 [z]
    float weight_decay;   // L2 penalty added to the gradient, 0 = none [z]
    int nesterov;         // Nesterov momentum; needs momentum > 0 and dampening 0
    int maximize;         // ascend the objective
    mn_dtype dtype;       // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_sgd_params;

typedef struct mn_sgd {
    mn_sgd_params params;     // resolved
    uint64_t n;               // elements
    uint64_t step;            // steps taken
    float *momentum_buffer;   // [n], NULL without momentum
    uint64_t state_bytes;     // == mn_sgd_state_bytes(dims, ndim, momentum != 0)
    mn_allocator alloc;
} mn_sgd;

MNDEF mn_result mn_sgd_init(mn_sgd *s, const uint64_t *dims, uint32_t ndim, const mn_sgd_params *p,
                            const mn_allocator *alloc);
MNDEF mn_result mn_sgd_step(mn_sgd *s, float *param, const float *grad, uint16_t *param16);
MNDEF void mn_sgd_free(mn_sgd *s);

// --- AdamW (torch.optim.AdamW) -----------------------------------------------------------------
typedef struct mn_adamw_params {
    float lr;             // 0 = 1e-3 [z]
    float beta1;          // 0 = 0.9 [z]
    float beta2;          // 0 = 0.999 [z]
    float eps;            // added to sqrt(v_hat), 0 = 1e-8 [z]
    float weight_decay;   // decoupled: param *= 1 - lr * weight_decay, 0 = 1e-2 [z]
    int amsgrad;          // use the running max of v (one more [n] fp32 array)
    int maximize;         // ascend the objective
    mn_dtype dtype;       // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_adamw_params;

typedef struct mn_adamw {
    mn_adamw_params params;   // resolved
    uint64_t n, step;
    float *exp_avg;           // [n] m
    float *exp_avg_sq;        // [n] v
    float *max_exp_avg_sq;    // [n] amsgrad only, else NULL
    uint64_t state_bytes;     // == mn_optim_state_bytes({ADAMW, .amsgrad}, dims, ndim)
    mn_allocator alloc;
} mn_adamw;

MNDEF mn_result mn_adamw_init(mn_adamw *s, const uint64_t *dims, uint32_t ndim,
                              const mn_adamw_params *p, const mn_allocator *alloc);
MNDEF mn_result mn_adamw_step(mn_adamw *s, float *param, const float *grad, uint16_t *param16);
MNDEF void mn_adamw_free(mn_adamw *s);

// --- 8-bit AdamW (bitsandbytes AdamW8bit, block-wise dynamic quantization) ----------------------
typedef struct mn_adamw8bit_params {
    float lr;               // 0 = 1e-3 [z]
    float beta1;            // 0 = 0.9 [z]
    float beta2;            // 0 = 0.999 [z]
    float eps;              // 0 = 1e-8 [z]
    float weight_decay;     // param *= 1 - lr * weight_decay after the Adam step, 0 = 1e-2 [z]
    uint32_t block_size;    // elements per absmax block, 1..4096, 0 = 256 (step: 32 KiB stack)
    uint64_t min_8bit_size; // tensors with fewer elements keep fp32 m and v, 0 = 4096
    mn_dtype dtype;         // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_adamw8bit_params;

typedef struct mn_adamw8bit {
    mn_adamw8bit_params params;  // resolved
    uint64_t n, step;
    uint64_t blocks;             // ceil(n / block_size) when quantized, else 0
    int quantized;               // n >= min_8bit_size: m and v are 8-bit codes
    uint8_t *code1;              // [n] m as indices into the signed dynamic map
    uint8_t *code2;              // [n] v as indices into the unsigned dynamic map
    float *absmax1, *absmax2;    // [blocks] per-block scale of m and v
    float *exp_avg, *exp_avg_sq; // [n] fp32 m and v of a small tensor (quantized == 0)
    uint64_t state_bytes;        // == mn_adamw8bit_state_bytes(dims, ndim, block, min_8bit)
    mn_allocator alloc;
} mn_adamw8bit;

MNDEF mn_result mn_adamw8bit_init(mn_adamw8bit *s, const uint64_t *dims, uint32_t ndim,
                                  const mn_adamw8bit_params *p, const mn_allocator *alloc);
MNDEF mn_result mn_adamw8bit_step(mn_adamw8bit *s, float *param, const float *grad,
                                  uint16_t *param16);
MNDEF void mn_adamw8bit_free(mn_adamw8bit *s);

// The 256-entry dynamic quantization map of bitsandbytes create_dynamic_map(signed, 7, 8), sorted
// ascending: signed = 127 negatives down to -0.993, 0, 128 positives up to 1.0 (smallest
// magnitude 5.5e-7); unsigned = 0 and 255 positives up to 1.0 (smallest 3.25e-7).
MNDEF void mn_dynamic_map(int is_signed, float map[256]);
// Block-wise quantization: absmax[b] = max |x| over block b, codes[i] = index of the map entry
// nearest to x[i] / absmax[b]. map [256] ascending, x [n], codes [n], absmax [ceil(n/block)].
MNDEF mn_result mn_quantize_blockwise(const float *map, const float *x, uint64_t n,
                                      uint32_t block_size, uint8_t *codes, float *absmax);
// x[i] = map[codes[i]] * absmax[i / block_size].
MNDEF mn_result mn_dequantize_blockwise(const float *map, const uint8_t *codes,
                                        const float *absmax, uint64_t n, uint32_t block_size,
                                        float *x);

// --- Adafactor (transformers.optimization.Adafactor) -------------------------------------------
typedef struct mn_adafactor_params {
    float lr;               // > 0: fixed step (relative_step=False); 0 = relative step
    float eps1;             // added to g^2, 0 = 1e-30
    float eps2;             // floor of the parameter scale RMS(param), 0 = 1e-3
    float clip_threshold;   // update clipping threshold d, 0 = 1.0
    float decay_rate;       // beta2_t = 1 - t^decay_rate, 0 = -0.8
    float beta1;            // first moment decay, 0 = no first moment (transformers beta1=None)
    float weight_decay;     // param -= weight_decay * alpha_t * param, 0 = none
    int no_scale_parameter; // 1: alpha_t = rho_t (transformers scale_parameter=False)
    int warmup_init;        // relative step min(1e-6 t, 1/sqrt t) instead of min(1e-2, 1/sqrt t)
    mn_dtype dtype;         // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_adafactor_params;

typedef struct mn_adafactor {
    mn_adafactor_params params;  // resolved
    uint64_t n, step;
    int factored;                // ndim >= 2: second moment kept as row and column means
    uint64_t batch, rows, cols;  // factored [batch, rows, cols] = [prod(dims[:-2]), d[-2], d[-1]]
    float *exp_avg_sq_row;       // [batch, rows] factored
    float *exp_avg_sq_col;       // [batch, cols] factored
    float *exp_avg_sq;           // [n] not factored
    float *exp_avg;              // [n] with beta1
    float rms;                   // RMS(param) before the last step (transformers state["RMS"])
    float alpha;                 // step size alpha_t of the last step
    uint64_t state_bytes;        // == mn_adafactor_state_bytes(dims, ndim, beta1 != 0)
    mn_allocator alloc;
} mn_adafactor;

MNDEF mn_result mn_adafactor_init(mn_adafactor *s, const uint64_t *dims, uint32_t ndim,
                                  const mn_adafactor_params *p, const mn_allocator *alloc);
MNDEF mn_result mn_adafactor_step(mn_adafactor *s, float *param, const float *grad,
                                  uint16_t *param16);
MNDEF void mn_adafactor_free(mn_adafactor *s);

// --- Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") -------------------
typedef struct mn_lion_params {
    float lr;             // 0 = 1e-4 [z]
    float beta1;          // interpolation for the update sign, 0 = 0.9 [z]
    float beta2;          // momentum decay, 0 = 0.99 [z]
    float weight_decay;   // decoupled: param *= 1 - lr * weight_decay, 0 = none [z]
    mn_dtype dtype;       // parameter tensor type: 0 = fp32, MN_FP16/MN_BF16 = param16 written
} mn_lion_params;

typedef struct mn_lion {
    mn_lion_params params;  // resolved
    uint64_t n, step;
    float *exp_avg;         // [n] momentum m
    uint64_t state_bytes;   // == mn_lion_state_bytes(dims, ndim)
    mn_allocator alloc;
} mn_lion;

MNDEF mn_result mn_lion_init(mn_lion *s, const uint64_t *dims, uint32_t ndim,
                             const mn_lion_params *p, const mn_allocator *alloc);
MNDEF mn_result mn_lion_step(mn_lion *s, float *param, const float *grad, uint16_t *param16);
MNDEF void mn_lion_free(mn_lion *s);

// --- Gradient clipping by global norm (torch.nn.utils.clip_grad_norm_) --------------------------
// grads[k] [sizes[k]] for k < count. total = (sum over all elements |g|^p)^(1/p) (max |g| for
// p = INFINITY); every gradient is multiplied by min(1, max_norm / (total + 1e-6)).
// norm_type 0 = 2.
// *total_norm (may be NULL) receives the norm before clipping; a non-finite norm makes the
// gradients non-finite, as in torch.
MNDEF mn_result mn_clip_grad_norm(float *const *grads, const uint64_t *sizes, uint32_t count,
                                  float max_norm, float norm_type, float *total_norm);

// --- Dynamic loss scaling (torch.amp.GradScaler) -----------------------------------------------
typedef struct mn_loss_scaler_params {
    float init_scale;          // 0 = 65536 (2^16)
    float growth_factor;       // > 1, 0 = 2.0
    float backoff_factor;      // in (0, 1), 0 = 0.5
    uint32_t growth_interval;  // clean steps before growth, 0 = 2000
} mn_loss_scaler_params;

typedef struct mn_loss_scaler {
    mn_loss_scaler_params params;  // resolved
    float scale;                   // multiply the loss by this before backward
    uint32_t growth_tracker;       // consecutive clean steps since the last change
    uint64_t steps, skipped;       // updates seen, steps skipped for inf/NaN gradients
} mn_loss_scaler;

MNDEF mn_result mn_loss_scaler_init(mn_loss_scaler *s, const mn_loss_scaler_params *p);
// 1 / scale, rounded to fp32 from double as GradScaler does; the argument of the unscale calls.
MNDEF float mn_loss_scaler_inv_scale(const mn_loss_scaler *s);
// Once per step, after the found-inf check: found_inf -> scale *= backoff, tracker = 0, skip the
// step; else tracker += 1 and at growth_interval scale *= growth (when finite), tracker = 0.
// *skip_step (may be NULL) is 1 when the optimizer step must be skipped.
MNDEF mn_result mn_loss_scaler_update(mn_loss_scaler *s, int found_inf, int *skip_step);

// Unscale in place: grad [n] of dtype (0/MN_FP32, MN_FP16, MN_BF16) *= inv_scale, computed in fp32.
// *found_inf is set to 1 when any input is inf or NaN and left as it was otherwise, so one flag
// can collect every tensor of a step (zero it once per step).
MNDEF mn_result mn_unscale_grads(mn_dtype dtype, void *grad, uint64_t n, float inv_scale,
                                 int *found_inf);
// The same into an fp32 array: dst [n] = src [n] (dtype) * inv_scale.
MNDEF mn_result mn_unscale_grads_to_fp32(mn_dtype dtype, const void *src, float *dst, uint64_t n,
                                         float inv_scale, int *found_inf);

// --- fp16 / bf16 conversion --------------------------------------------------------------------
// fp32 -> 16 bits rounds to nearest even, overflows to inf, keeps subnormals; NaN stays NaN with
// its sign and top payload bits, quieted. 16 bits -> fp32 is exact (NaN quieted).
MNDEF uint16_t mn_fp32_to_fp16(float f);
MNDEF float mn_fp16_to_fp32(uint16_t h);
MNDEF uint16_t mn_fp32_to_bf16(float f);
MNDEF float mn_bf16_to_fp32(uint16_t b);
// Bulk versions: src [n] -> dst [n].
MNDEF void mn_fp32_to_fp16_array(const float *src, uint16_t *dst, uint64_t n);
MNDEF void mn_fp16_to_fp32_array(const uint16_t *src, float *dst, uint64_t n);
MNDEF void mn_fp32_to_bf16_array(const float *src, uint16_t *dst, uint64_t n);
MNDEF void mn_bf16_to_fp32_array(const uint16_t *src, float *dst, uint64_t n);
