// >>optim implementation ------------------------------------------------------------------------
//
// State per parameter tensor of n elements (fp32 master):
//   SGD 0; SGD+momentum n*4 (momentum_buffer); AdamW n*8 (exp_avg, exp_avg_sq), +n*4 with amsgrad
//   (max_exp_avg_sq); Lion n*4 (exp_avg);
//   8-bit AdamW: n >= min_8bit_size -> 2 uint8 codes per element + one fp32 absmax per block for
//     each state, else 32-bit AdamW (bitsandbytes optim/optimizer.py, Optimizer8bit.init_state);
//   Adafactor (transformers optimization.py): ndim >= 2 -> row means (prod of dims[:-1]) + column
//     means (prod of dims[:-2] * dims[-1]) in fp32, ndim 1 -> full exp_avg_sq; + n*4 if beta1.
// Element updates run in fp32 like the reference implementations; scalars (bias corrections, step
// sizes) and reductions (norms, means) run in double.

MN__PRIVATE mn_result mn__numel(const uint64_t *dims, uint32_t ndim, uint64_t *out) {
    uint64_t n = 1;
    uint32_t i;
    if (!dims || ndim == 0 || ndim > 8 || !out) return MN_ERR_INVALID_ARG;
    for (i = 0; i < ndim; i++) {
        if (dims[i] == 0) return MN_ERR_INVALID_ARG;
        if (mn_mul_u64(n, dims[i], &n) != MN_OK) return MN_ERR_OVERFLOW;
    }
    *out = n;
    return MN_OK;
}

MNIMPL mn_result mn_sgd_state_bytes(const uint64_t *dims, uint32_t ndim, int momentum,
                                    uint64_t *out) {
    uint64_t n;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out) return MN_ERR_INVALID_ARG;
    if (!momentum) { *out = 0; return MN_OK; }
    return mn_mul_u64(n, 4, out);
}

MNIMPL mn_result mn_adamw_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out) {
    uint64_t n;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out) return MN_ERR_INVALID_ARG;
    return mn_mul_u64(n, 8, out);
}

MNIMPL mn_result mn_lion_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out) {
    uint64_t n;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out) return MN_ERR_INVALID_ARG;
    return mn_mul_u64(n, 4, out);
}

MNIMPL mn_result mn_adamw8bit_state_bytes(const uint64_t *dims, uint32_t ndim, uint32_t block_size,
                                          uint64_t min_8bit_size, uint64_t *out) {
    uint64_t n, blocks, codes, scales;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out) return MN_ERR_INVALID_ARG;
    if (block_size == 0) block_size = 256;
    if (min_8bit_size == 0) min_8bit_size = 4096;
    if (n < min_8bit_size) return mn_mul_u64(n, 8, out);
    blocks = n / block_size + (n % block_size != 0);
    // two uint8 states (n each) + two fp32 absmax arrays (blocks each)
    if (mn_mul_u64(n, 2, &codes) != MN_OK) return MN_ERR_OVERFLOW;
    if (mn_mul_u64(blocks, 8, &scales) != MN_OK) return MN_ERR_OVERFLOW;
    return mn_add_u64(codes, scales, out);
}

MNIMPL mn_result mn_adafactor_state_bytes(const uint64_t *dims, uint32_t ndim, int beta1,
                                          uint64_t *out) {
    uint64_t n, floats, m = 0;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!out) return MN_ERR_INVALID_ARG;
    if (ndim >= 2) {
        // prod(dims[:-1]) row means + prod(dims[:-2]) * dims[-1] column means
        r = mn_add_u64(n / dims[ndim - 1], n / dims[ndim - 2], &floats);
        if (r != MN_OK) return r;
    } else {
        floats = n;
    }
    if (beta1) m = n;
    if (mn_add_u64(floats, m, &floats) != MN_OK) return MN_ERR_OVERFLOW;
    return mn_mul_u64(floats, 4, out);
}

MNIMPL mn_result mn_optim_state_bytes(const mn_optim_desc *d, const uint64_t *dims, uint32_t ndim,
                                      uint64_t *out) {
    mn_optim kind = d ? d->kind : MN_OPTIM_DEFAULT;
    if (!out) return MN_ERR_INVALID_ARG;
    switch (kind) {
    case MN_OPTIM_DEFAULT:
    case MN_OPTIM_ADAMW: {
        uint64_t n = 0, extra;
        mn_result r = mn_adamw_state_bytes(dims, ndim, out);
        if (r != MN_OK || !d || !d->amsgrad) return r;
        if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
        if (mn_mul_u64(n, 4, &extra) != MN_OK) return MN_ERR_OVERFLOW;
        return mn_add_u64(*out, extra, out);
    }
    case MN_OPTIM_ADAMW_8BIT:
        return mn_adamw8bit_state_bytes(dims, ndim, d ? d->block_size : 0,
                                        d ? d->min_8bit_size : 0, out);
    case MN_OPTIM_SGD: return mn_sgd_state_bytes(dims, ndim, 0, out);
    case MN_OPTIM_SGD_MOMENTUM: return mn_sgd_state_bytes(dims, ndim, 1, out);
    case MN_OPTIM_ADAFACTOR:
        return mn_adafactor_state_bytes(dims, ndim, d ? d->adafactor_beta1 : 0, out);
    case MN_OPTIM_LION: return mn_lion_state_bytes(dims, ndim, out);
    case MN_OPTIM_NONE: {
        uint64_t n;
        mn_result r = mn__numel(dims, ndim, &n);
        if (r == MN_OK) *out = 0;
        return r;
    }
    case MN_OPTIM_COUNT: break;
    }
    return MN_ERR_INVALID_ARG;
}

// --- fp16 / bf16 conversion ----------------------------------------------------------------------
//
// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits; bfloat16: the top 16 bits of an
// fp32 (8 exponent bits, bias 127, 7 mantissa bits). fp32 -> 16 bits: keep the sign, rebias the
// exponent, shift the mantissa right rounding to nearest with ties to even (IEEE 754-2008 4.3.1);
// a mantissa carry moves into the exponent, which makes the overflow to inf come out right
// (fp16: |x| >= 65520 -> inf). Results below 2^-14 become fp16 subnormals (unit 2^-24).
// NaNs keep sign and top payload bits and get the quiet bit, as x86 F16C and ARM FCVT do.

MN__PRIVATE uint32_t mn__opt_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

MN__PRIVATE float mn__opt_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

MN__PRIVATE int mn__opt_finite(float f) { return (mn__opt_bits(f) & 0x7f800000u) != 0x7f800000u; }

// m >> s rounded to nearest, ties to even; m < 2^24, so s >= 25 always gives 0.
MN__PRIVATE uint32_t mn__opt_shr_rne(uint32_t m, uint32_t s) {
    uint32_t q, rem, half;
    if (s >= 25) return 0;
    q = m >> s;
    rem = m & ((1u << s) - 1u);
    half = 1u << (s - 1);
    return q + ((uint32_t)(rem > half) | ((uint32_t)(rem == half) & q & 1u));
}

MNIMPL uint16_t mn_fp32_to_fp16(float f) {
    uint32_t x = mn__opt_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    int32_t he = (int32_t)e - 127 + 15;  // binary16 biased exponent
    if (e == 0xffu) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u | (m >> 13) : 0u));
    if (he >= 31) return (uint16_t)(sign | 0x7c00u);
    if (he >= 1) return (uint16_t)(sign | (((uint32_t)he << 10) + mn__opt_shr_rne(m, 13)));
    if (e == 0) return (uint16_t)sign;  // fp32 subnormals are far below 2^-25
    // |x| = (2^23 + m) * 2^(e-150) = q * 2^-24 with q = (2^23 + m) >> (126 - e), shift >= 14
    return (uint16_t)(sign | mn__opt_shr_rne(m | 0x800000u, (uint32_t)(126 - (int32_t)e)));
}

MNIMPL float mn_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return mn__opt_float(sign | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0u));
    if (e != 0) return mn__opt_float(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return mn__opt_float(sign);
    e = 113;  // subnormal m * 2^-24: normalize so that bit 10 is the implicit one
    while (!(m & 0x400u)) m <<= 1, e--;
    return mn__opt_float(sign | (e << 23) | ((m & 0x3ffu) << 13));
}

MNIMPL uint16_t mn_fp32_to_bf16(float f) {
    uint32_t x = mn__opt_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

MNIMPL float mn_bf16_to_fp32(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    if ((x & 0x7fffffffu) > 0x7f800000u) x |= 0x400000u;
    return mn__opt_float(x);
}

MNIMPL void mn_fp32_to_fp16_array(const float *src, uint16_t *dst, uint64_t n) {
    uint64_t i;
    for (i = 0; i < n; i++) dst[i] = mn_fp32_to_fp16(src[i]);
}

MNIMPL void mn_fp16_to_fp32_array(const uint16_t *src, float *dst, uint64_t n) {
    uint64_t i;
    for (i = 0; i < n; i++) dst[i] = mn_fp16_to_fp32(src[i]);
}

MNIMPL void mn_fp32_to_bf16_array(const float *src, uint16_t *dst, uint64_t n) {
    uint64_t i;
    for (i = 0; i < n; i++) dst[i] = mn_fp32_to_bf16(src[i]);
}

MNIMPL void mn_bf16_to_fp32_array(const uint16_t *src, float *dst, uint64_t n) {
    uint64_t i;
    for (i = 0; i < n; i++) dst[i] = mn_bf16_to_fp32(src[i]);
}

// --- shared optimizer plumbing -------------------------------------------------------------------

// A [z] hyperparameter: 0 selects the default, MN_OPTIM_ZERO an explicit zero.
MN__PRIVATE float mn__opt_z(float v, float def) {
    if (v == 0.0f) return def;
    if (v == MN_OPTIM_ZERO) return 0.0f;
    return v;
}

// lo <= v < hi (or <= hi when hi_incl), and finite.
MN__PRIVATE int mn__opt_in(float v, float lo, float hi, int hi_incl) {
    if (!mn__opt_finite(v) || v < lo) return 0;
    return hi_incl ? v <= hi : v < hi;
}

MN__PRIVATE mn_result mn__opt_dtype(mn_dtype *dt) {
    if (*dt == MN_DTYPE_DEFAULT) *dt = MN_FP32;
    return (*dt == MN_FP32 || *dt == MN_FP16 || *dt == MN_BF16) ? MN_OK : MN_ERR_INVALID_ARG;
}

// One zero-filled block of `bytes` for a state; NULL when bytes is 0.
MN__PRIVATE mn_result mn__opt_alloc(const mn_allocator *a, uint64_t bytes, void **out) {
    *out = NULL;
    if (bytes == 0) return MN_OK;
    if ((uint64_t)(size_t)bytes != bytes) return MN_ERR_OVERFLOW;
    *out = mn__alloc(a, (size_t)bytes);
    if (!*out) return MN_ERR_OUT_OF_MEMORY;
    memset(*out, 0, (size_t)bytes);
    return MN_OK;
}

MN__PRIVATE mn_result mn__opt_step_check(uint64_t n, const float *param, const float *grad,
                                         mn_dtype dt, const uint16_t *param16) {
    if (n == 0) return MN_ERR_STATE;  // not initialized, or freed
    if (!param || !grad) return MN_ERR_INVALID_ARG;
    if (dt != MN_FP32 && !param16) return MN_ERR_INVALID_ARG;
    return MN_OK;
}

// Rewrites the 16-bit model tensor from the fp32 master after a step.
MN__PRIVATE void mn__opt_store16(mn_dtype dt, const float *param, uint16_t *param16, uint64_t n) {
    if (dt == MN_FP16) mn_fp32_to_fp16_array(param, param16, n);
    else if (dt == MN_BF16) mn_fp32_to_bf16_array(param, param16, n);
}

MN__PRIVATE mn_allocator mn__opt_allocator(const mn_allocator *a) {
    mn_allocator z;
    memset(&z, 0, sizeof z);
    return a ? *a : z;
}

// torch.lerp for float: weight < 0.5 ? a + w (b - a) : b - (b - a)(1 - w)  (aten Lerp.h)
MN__PRIVATE float mn__opt_lerp(float a, float b, float w) {
    return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

// --- SGD -----------------------------------------------------------------------------------------
//
// torch.optim.SGD docs (algorithm box), per element with lr γ, momentum μ, dampening τ, decay λ:
//   g ← g + λθ;  b ← g at t = 1, else b ← μb + (1−τ)g;  g ← g + μb (nesterov) or g ← b;  θ ← θ − γg

MNIMPL mn_result mn_sgd_init(mn_sgd *s, const uint64_t *dims, uint32_t ndim, const mn_sgd_params *p,
                             const mn_allocator *alloc) {
    mn_sgd_params q;
    uint64_t n, bytes;
    void *mem;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__opt_z(q.lr, 1e-3f);
    q.momentum = mn__opt_z(q.momentum, 0.0f);
    q.dampening = mn__opt_z(q.dampening, 0.0f);
    q.weight_decay = mn__opt_z(q.weight_decay, 0.0f);
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.momentum, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.dampening, 0.0f, 1.0f, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (q.nesterov && (q.momentum <= 0.0f || q.dampening != 0.0f)) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    if ((r = mn_sgd_state_bytes(dims, ndim, q.momentum != 0.0f, &bytes)) != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &mem)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    s->params = q;
    s->n = n;
    s->momentum_buffer = (float *)mem;
    s->state_bytes = bytes;
    return MN_OK;
}

MNIMPL mn_result mn_sgd_step(mn_sgd *s, float *param, const float *grad, uint16_t *param16) {
    float lr, mu, damp, wd, g;
    uint64_t i;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    lr = s->params.lr, mu = s->params.momentum;
    damp = s->params.dampening, wd = s->params.weight_decay;
    s->step++;
    for (i = 0; i < s->n; i++) {
        g = s->params.maximize ? -grad[i] : grad[i];
        if (wd != 0.0f) g = g + wd * param[i];
        if (mu != 0.0f) {
            float *b = &s->momentum_buffer[i];
            *b = s->step == 1 ? g : *b * mu + (1.0f - damp) * g;
            g = s->params.nesterov ? g + mu * *b : *b;
        }
        param[i] = param[i] - lr * g;
    }
    mn__opt_store16(s->params.dtype, param, param16, s->n);
    return MN_OK;
}

MNIMPL void mn_sgd_free(mn_sgd *s) {
    if (!s) return;
    mn__free(&s->alloc, s->momentum_buffer);
    memset(s, 0, sizeof *s);
}

// --- AdamW ---------------------------------------------------------------------------------------
//
// torch.optim.AdamW docs and torch/optim/adam.py (_single_tensor_adam, decoupled weight decay):
//   θ ← θ(1 − γλ);  m ← lerp(m, g, 1−β1);  v ← β2 v + (1−β2) g²;  amsgrad: v̄ ← max(v̄, v), use v̄
//   θ ← θ − (γ / (1−β1^t)) · m / (√v / √(1−β2^t) + ε)        (ε outside the square root)

MNIMPL mn_result mn_adamw_init(mn_adamw *s, const uint64_t *dims, uint32_t ndim,
                               const mn_adamw_params *p, const mn_allocator *alloc) {
    mn_adamw_params q;
    mn_optim_desc d;
    uint64_t n, bytes;
    void *mem;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__opt_z(q.lr, 1e-3f);
    q.beta1 = mn__opt_z(q.beta1, 0.9f);
    q.beta2 = mn__opt_z(q.beta2, 0.999f);
    q.eps = mn__opt_z(q.eps, 1e-8f);
    q.weight_decay = mn__opt_z(q.weight_decay, 1e-2f);
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta1, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta2, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.eps, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    memset(&d, 0, sizeof d);
    d.kind = MN_OPTIM_ADAMW;
    d.amsgrad = q.amsgrad != 0;
    if ((r = mn_optim_state_bytes(&d, dims, ndim, &bytes)) != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &mem)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    s->params = q;
    s->n = n;
    s->exp_avg = (float *)mem;
    s->exp_avg_sq = s->exp_avg + n;
    s->max_exp_avg_sq = q.amsgrad ? s->exp_avg_sq + n : NULL;
    s->state_bytes = bytes;
    return MN_OK;
}

MNIMPL mn_result mn_adamw_step(mn_adamw *s, float *param, const float *grad, uint16_t *param16) {
    const mn_adamw_params *p;
    double t, bc1, bc2;
    float decay, step_size, bc2_sqrt, w1, b2;
    uint64_t i;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    p = &s->params;
    t = (double)++s->step;
    bc1 = 1.0 - pow((double)p->beta1, t);
    bc2 = 1.0 - pow((double)p->beta2, t);
    decay = (float)(1.0 - (double)p->lr * (double)p->weight_decay);
    step_size = (float)((double)p->lr / bc1);
    bc2_sqrt = (float)sqrt(bc2);
    w1 = 1.0f - p->beta1, b2 = p->beta2;
    for (i = 0; i < s->n; i++) {
        float g = p->maximize ? -grad[i] : grad[i];
        float th = param[i] * decay, m, v, denom;
        m = s->exp_avg[i] = mn__opt_lerp(s->exp_avg[i], g, w1);
        v = s->exp_avg_sq[i] = s->exp_avg_sq[i] * b2 + (1.0f - b2) * g * g;
        if (p->amsgrad) {
            if (v > s->max_exp_avg_sq[i]) s->max_exp_avg_sq[i] = v;
            v = s->max_exp_avg_sq[i];
        }
        denom = sqrtf(v) / bc2_sqrt + p->eps;
        param[i] = th - step_size * (m / denom);
    }
    mn__opt_store16(p->dtype, param, param16, s->n);
    return MN_OK;
}

MNIMPL void mn_adamw_free(mn_adamw *s) {
    if (!s) return;
    mn__free(&s->alloc, s->exp_avg);
    memset(s, 0, sizeof *s);
}

// --- 8-bit AdamW ---------------------------------------------------------------------------------
//
// bitsandbytes (Dettmers et al. 2022, arXiv 2110.02861; csrc/kernels.cu
// kOptimizerStatic8bit2StateBlockwise, ADAM). Per block of B elements, with maps Q1 (signed) and
// Q2 (unsigned) and scales a1, a2:
//   m ← β1 Q1[c1]·a1 + (1−β1) g;   v ← β2 Q2[c2]·a2 + (1−β2) g²    (both 0 where g is inf/NaN)
//   a1 ← max|m|, a2 ← max v over the block;  c2 ← nearest(v/a2);
//   c1 ← nearest(m/a1), moved one entry down when m < 0 lands on 0 (the sign of m is kept)
//   θ ← θ − γ √(1−β2^t)/(1−β1^t) · m / (√v + ε√(1−β2^t));  θ ← θ(1 − γλ)  (decay after the step)
// The update uses the fp32 m and v before re-quantization. Tensors below min_8bit_size keep fp32 m
// and v with the same update (kOptimizer32bit2State). An element with a non-finite gradient is
// left unchanged. As in bitsandbytes, a v below about 1.6e-7 of its block's absmax is stored as 0,
// so an element whose gradient stays tiny while others are large can take one large step.

// create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) (bitsandbytes functional.py):
// for i = 0..6, midpoints of linspace(0.1, 1, 2^i + 1) (signed) or 2^(i+1) + 1 (unsigned) scaled
// by 10^(i-6), negated copies when signed, plus 0 and 1. The groups are disjoint and increasing,
// so writing them in order gives the sorted map. Computed in fp32 with torch.linspace's formula
// (start + step*k in the first half, end - step*(steps-1-k) in the second).
MNIMPL void mn_dynamic_map(int is_signed, float map[256]) {
    float pos[254];
    int npos = 0, i, k, j = 0;
    for (i = 0; i < 7; i++) {
        int steps = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1, half = steps / 2;
        float start = 0.1f, end = 1.0f, step = (end - start) / (float)(steps - 1), prev = 0.0f;
        float scale = (float)pow(10.0, (double)(i - 6));
        for (k = 0; k < steps; k++) {
            float b = k < half ? start + step * (float)k : end - step * (float)(steps - 1 - k);
            if (k > 0) pos[npos++] = scale * ((prev + b) / 2.0f);
            prev = b;
        }
    }
    if (is_signed)
        for (k = npos - 1; k >= 0; k--) map[j++] = -pos[k];
    map[j++] = 0.0f;
    for (k = 0; k < npos; k++) map[j++] = pos[k];
    map[j++] = 1.0f;
    MN_ASSERT(j == 256);
}

// Index of the map entry nearest to x (map ascending); ties go to the larger entry. Branch-free
// binary search: i ends as the number of entries below x, at most 255.
MN__PRIVATE uint8_t mn__opt_nearest(const float *map, float x) {
    uint32_t i = 0, step;
    for (step = 128; step > 0; step >>= 1) i += step & (0u - (uint32_t)(map[i + step - 1] < x));
    if (i == 0) return 0;
    return (uint8_t)(i - (uint32_t)(x - map[i - 1] < map[i] - x));
}

MNIMPL mn_result mn_quantize_blockwise(const float *map, const float *x, uint64_t n,
                                       uint32_t block_size, uint8_t *codes, float *absmax) {
    uint64_t b, i, i0, end;
    if (!map || !x || !codes || !absmax || block_size == 0) return MN_ERR_INVALID_ARG;
    for (b = 0, i0 = 0; i0 < n; b++, i0 += block_size) {
        float am = 0.0f, inv;
        end = n - i0 < block_size ? n : i0 + block_size;
        for (i = i0; i < end; i++) {
            float a = fabsf(x[i]);
            if (a > am) am = a;
        }
        absmax[b] = am;
        inv = am > 0.0f ? 1.0f / am : 0.0f;
        for (i = i0; i < end; i++) codes[i] = mn__opt_nearest(map, x[i] * inv);
    }
    return MN_OK;
}

MNIMPL mn_result mn_dequantize_blockwise(const float *map, const uint8_t *codes,
                                         const float *absmax, uint64_t n, uint32_t block_size,
                                         float *x) {
    uint64_t i;
    if (!map || !codes || !absmax || !x || block_size == 0) return MN_ERR_INVALID_ARG;
    for (i = 0; i < n; i++) x[i] = map[codes[i]] * absmax[i / block_size];
    return MN_OK;
}

#define MN__OPT_MAX_BLOCK 4096u

MNIMPL mn_result mn_adamw8bit_init(mn_adamw8bit *s, const uint64_t *dims, uint32_t ndim,
                                   const mn_adamw8bit_params *p, const mn_allocator *alloc) {
    mn_adamw8bit_params q;
    uint64_t n, bytes;
    void *mem;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__opt_z(q.lr, 1e-3f);
    q.beta1 = mn__opt_z(q.beta1, 0.9f);
    q.beta2 = mn__opt_z(q.beta2, 0.999f);
    q.eps = mn__opt_z(q.eps, 1e-8f);
    q.weight_decay = mn__opt_z(q.weight_decay, 1e-2f);
    if (q.block_size == 0) q.block_size = 256;
    if (q.min_8bit_size == 0) q.min_8bit_size = 4096;
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta1, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta2, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.eps, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (q.block_size > MN__OPT_MAX_BLOCK) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    r = mn_adamw8bit_state_bytes(dims, ndim, q.block_size, q.min_8bit_size, &bytes);
    if (r != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &mem)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    s->params = q;
    s->n = n;
    s->state_bytes = bytes;
    s->quantized = n >= q.min_8bit_size;
    if (s->quantized) {  // [absmax1 | absmax2 | code1 | code2]: the floats first keep them aligned
        s->blocks = n / q.block_size + (n % q.block_size != 0);
        s->absmax1 = (float *)mem;
        s->absmax2 = s->absmax1 + s->blocks;
        s->code1 = (uint8_t *)(s->absmax2 + s->blocks);
        s->code2 = s->code1 + n;
    } else {
        s->exp_avg = (float *)mem;
        s->exp_avg_sq = s->exp_avg + n;
    }
    return MN_OK;
}

MNIMPL mn_result mn_adamw8bit_step(mn_adamw8bit *s, float *param, const float *grad,
                                   uint16_t *param16) {
    const mn_adamw8bit_params *p;
    float map1[256], map2[256], mbuf[MN__OPT_MAX_BLOCK], vbuf[MN__OPT_MAX_BLOCK];
    float b1, b2, step_size, eps_c, decay;
    double t, c1, c2;
    uint64_t i, j, b, i0, len;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    p = &s->params;
    t = (double)++s->step;
    b1 = p->beta1, b2 = p->beta2;
    c1 = 1.0 - pow((double)b1, t);
    c2 = sqrt(1.0 - pow((double)b2, t));
    step_size = (float)(-(double)p->lr * c2 / c1);
    eps_c = (float)((double)p->eps * c2);
    decay = (float)(1.0 - (double)p->lr * (double)p->weight_decay);
    if (!s->quantized) {
        for (i = 0; i < s->n; i++) {
            float g = grad[i], m, v;
            if (!mn__opt_finite(g)) continue;
            m = s->exp_avg[i] = s->exp_avg[i] * b1 + (1.0f - b1) * g;
            v = s->exp_avg_sq[i] = s->exp_avg_sq[i] * b2 + (1.0f - b2) * g * g;
            param[i] = param[i] + step_size * (m / (sqrtf(v) + eps_c));
            if (p->weight_decay > 0.0f) param[i] = param[i] * decay;
        }
        mn__opt_store16(p->dtype, param, param16, s->n);
        return MN_OK;
    }
    mn_dynamic_map(1, map1);
    mn_dynamic_map(0, map2);
    for (b = 0, i0 = 0; b < s->blocks; b++, i0 += p->block_size) {
        float a1 = s->absmax1[b], a2 = s->absmax2[b], n1 = 0.0f, n2 = 0.0f, inv1, inv2;
        len = s->n - i0 < p->block_size ? s->n - i0 : p->block_size;
        for (j = 0; j < len; j++) {  // dequantize, update the moments, new block scales
            float g = grad[i0 + j], m = 0.0f, v = 0.0f;
            if (mn__opt_finite(g)) {
                m = map1[s->code1[i0 + j]] * a1 * b1 + (1.0f - b1) * g;
                v = map2[s->code2[i0 + j]] * a2 * b2 + (1.0f - b2) * g * g;
            }
            mbuf[j] = m, vbuf[j] = v;
            if (fabsf(m) > n1) n1 = fabsf(m);
            if (v > n2) n2 = v;
        }
        s->absmax1[b] = n1, s->absmax2[b] = n2;
        inv1 = n1 > 0.0f ? 1.0f / n1 : 0.0f;
        inv2 = n2 > 0.0f ? 1.0f / n2 : 0.0f;
        for (j = 0; j < len; j++) {  // parameter update from fp32 m, v; re-quantize
            float m = mbuf[j];
            uint8_t c;
            if (mn__opt_finite(grad[i0 + j])) {
                float *th = &param[i0 + j];
                *th = *th + step_size * (m / (sqrtf(vbuf[j]) + eps_c));
                if (p->weight_decay > 0.0f) *th = *th * decay;
            }
            c = mn__opt_nearest(map1, m * inv1);
            if (m < 0.0f && map1[c] >= 0.0f) c--;  // a negative m never rounds to 0 or above
            s->code1[i0 + j] = c;
            s->code2[i0 + j] = mn__opt_nearest(map2, vbuf[j] * inv2);
        }
    }
    mn__opt_store16(p->dtype, param, param16, s->n);
    return MN_OK;
}

MNIMPL void mn_adamw8bit_free(mn_adamw8bit *s) {
    if (!s) return;
    mn__free(&s->alloc, s->quantized ? (void *)s->absmax1 : (void *)s->exp_avg);
    memset(s, 0, sizeof *s);
}

// --- Adafactor -----------------------------------------------------------------------------------
//
// Shazeer & Stern 2018 (arXiv 1804.04235), as transformers/optimization.py Adafactor.step:
//   ρ_t = lr, or min(1e-2 (1e-6 t with warmup_init), 1/√t) with the relative step
//   α_t = max(ε2, RMS(θ)) ρ_t (scale_parameter) or ρ_t;   β̂2 = 1 − t^decay_rate;   U = g² + ε1
//   matrix [.., r, c]: R ← β̂2 R + (1−β̂2) mean_c(U);  C ← β̂2 C + (1−β̂2) mean_r(U)
//                      u = g · rsqrt(R / mean_r(R)) ⊗ rsqrt(C)
//   vector:            V ← β̂2 V + (1−β̂2) U;  u = g · rsqrt(V)
//   u ← α_t u / max(1, RMS(u)/d);  (β1: m ← β1 m + (1−β1) u, u = m);  θ ← θ − λα_t θ;  θ ← θ − u
// RMS(x) = ‖x‖₂/√numel. u is recomputed from the state in each pass instead of stored, so the
// state is exactly the moments.

MNIMPL mn_result mn_adafactor_init(mn_adafactor *s, const uint64_t *dims, uint32_t ndim,
                                   const mn_adafactor_params *p, const mn_allocator *alloc) {
    mn_adafactor_params q;
    uint64_t n, bytes;
    float *mem;
    void *raw;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    if (q.eps1 == 0.0f) q.eps1 = 1e-30f;
    if (q.eps2 == 0.0f) q.eps2 = 1e-3f;
    if (q.clip_threshold == 0.0f) q.clip_threshold = 1.0f;
    if (q.decay_rate == 0.0f) q.decay_rate = -0.8f;
    q.beta1 = mn__opt_z(q.beta1, 0.0f);
    q.weight_decay = mn__opt_z(q.weight_decay, 0.0f);
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.eps1, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.eps2, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.clip_threshold, FLT_MIN, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.decay_rate, -FLT_MAX, 0.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta1, 0.0f, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    if ((r = mn_adafactor_state_bytes(dims, ndim, q.beta1 != 0.0f, &bytes)) != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &raw)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    mem = (float *)raw;
    s->params = q;
    s->n = n;
    s->state_bytes = bytes;
    s->factored = ndim >= 2;
    if (s->factored) {
        s->cols = dims[ndim - 1];
        s->rows = dims[ndim - 2];
        s->batch = n / (s->rows * s->cols);
        s->exp_avg_sq_row = mem;
        s->exp_avg_sq_col = mem + s->batch * s->rows;
        mem = s->exp_avg_sq_col + s->batch * s->cols;
    } else {
        s->batch = 1, s->rows = 1, s->cols = n;
        s->exp_avg_sq = mem;
        mem += n;
    }
    s->exp_avg = q.beta1 != 0.0f ? mem : NULL;
    return MN_OK;
}

// Mean of R over the rows of batch b, the normalizer of the factored second moment.
MN__PRIVATE double mn__opt_row_mean(const mn_adafactor *s, uint64_t b) {
    const float *row = s->exp_avg_sq_row + b * s->rows;
    double sum = 0.0;
    uint64_t i;
    for (i = 0; i < s->rows; i++) sum += row[i];
    return sum / (double)s->rows;
}

MNIMPL mn_result mn_adafactor_step(mn_adafactor *s, float *param, const float *grad,
                                   uint16_t *param16) {
    const mn_adafactor_params *p;
    double t, sum, rho, beta2t, rms_u, clip;
    float b2t, w2t, eps1, alpha, clip_div, decay_coef;
    uint64_t i, j, b, c0, cw, n;
    int pass;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    p = &s->params;
    n = s->n;
    t = (double)++s->step;
    for (sum = 0.0, i = 0; i < n; i++) sum += (double)param[i] * param[i];
    s->rms = (float)sqrt(sum / (double)n);
    if (p->lr > 0.0f) rho = p->lr;
    else rho = fmin(p->warmup_init ? 1e-6 * t : 1e-2, 1.0 / sqrt(t));
    alpha = (float)(p->no_scale_parameter ? rho : fmax((double)p->eps2, (double)s->rms) * rho);
    s->alpha = alpha;
    beta2t = 1.0 - pow(t, (double)p->decay_rate);
    b2t = (float)beta2t, w2t = (float)(1.0 - beta2t), eps1 = p->eps1;
    // second moment
    if (s->factored) {
        for (b = 0; b < s->batch; b++) {
            const float *gb = grad + b * s->rows * s->cols;
            float *row = s->exp_avg_sq_row + b * s->rows, *col = s->exp_avg_sq_col + b * s->cols;
            for (i = 0; i < s->rows; i++) {
                const float *gr = gb + i * s->cols;
                for (sum = 0.0, j = 0; j < s->cols; j++) sum += (double)(gr[j] * gr[j] + eps1);
                row[i] = row[i] * b2t + w2t * (float)(sum / (double)s->cols);
            }
            for (c0 = 0; c0 < s->cols; c0 += 64) {  // column means, 64 columns at a time
                double acc[64] = {0};
                cw = s->cols - c0 < 64 ? s->cols - c0 : 64;
                for (i = 0; i < s->rows; i++)
                    for (j = 0; j < cw; j++) {
                        float g = gb[i * s->cols + c0 + j];
                        acc[j] += (double)(g * g + eps1);
                    }
                for (j = 0; j < cw; j++)
                    col[c0 + j] = col[c0 + j] * b2t + w2t * (float)(acc[j] / (double)s->rows);
            }
        }
    } else {
        for (i = 0; i < n; i++)
            s->exp_avg_sq[i] = s->exp_avg_sq[i] * b2t + w2t * (grad[i] * grad[i] + eps1);
    }
    // pass 0: RMS of the update; pass 1: apply it
    clip_div = 1.0f;
    decay_coef = -p->weight_decay * alpha;
    for (pass = 0, rms_u = 0.0; pass < 2; pass++) {
        double ss = 0.0;
        for (b = 0; b < s->batch; b++) {
            const float *row = s->factored ? s->exp_avg_sq_row + b * s->rows : NULL;
            const float *col = s->factored ? s->exp_avg_sq_col + b * s->cols : NULL;
            float rmean = s->factored ? (float)mn__opt_row_mean(s, b) : 1.0f;
            for (i = 0; i < s->rows; i++) {
                float rf = s->factored ? 1.0f / sqrtf(row[i] / rmean) : 1.0f;
                uint64_t base = (b * s->rows + i) * s->cols;
                for (j = 0; j < s->cols; j++) {
                    uint64_t k = base + j;
                    float u = s->factored ? rf * (1.0f / sqrtf(col[j])) * grad[k]
                                          : (1.0f / sqrtf(s->exp_avg_sq[k])) * grad[k];
                    if (pass == 0) {
                        ss += (double)u * u;
                        continue;
                    }
                    u = u / clip_div * alpha;
                    if (s->exp_avg)
                        u = s->exp_avg[k] = s->exp_avg[k] * p->beta1 + (1.0f - p->beta1) * u;
                    if (p->weight_decay != 0.0f) param[k] = param[k] + decay_coef * param[k];
                    param[k] = param[k] - u;
                }
            }
        }
        if (pass == 0) {
            rms_u = sqrt(ss / (double)n);
            clip = rms_u / (double)p->clip_threshold;
            clip_div = (float)(clip > 1.0 ? clip : 1.0);  // the divisor max(1, RMS(u)/d)
        }
    }
    mn__opt_store16(p->dtype, param, param16, n);
    return MN_OK;
}

MNIMPL void mn_adafactor_free(mn_adafactor *s) {
    if (!s) return;
    mn__free(&s->alloc, s->factored ? s->exp_avg_sq_row : s->exp_avg_sq);
    memset(s, 0, sizeof *s);
}

// --- Lion ----------------------------------------------------------------------------------------
//
// Chen et al. 2023 (arXiv 2302.06675, Algorithm 2) and lion-pytorch:
//   θ ← θ(1 − γλ);  c = β1 m + (1−β1) g;  θ ← θ − γ sign(c);  m ← β2 m + (1−β2) g   (sign(0) = 0)

MNIMPL mn_result mn_lion_init(mn_lion *s, const uint64_t *dims, uint32_t ndim,
                              const mn_lion_params *p, const mn_allocator *alloc) {
    mn_lion_params q;
    uint64_t n, bytes;
    void *mem;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    q.lr = mn__opt_z(q.lr, 1e-4f);
    q.beta1 = mn__opt_z(q.beta1, 0.9f);
    q.beta2 = mn__opt_z(q.beta2, 0.99f);
    q.weight_decay = mn__opt_z(q.weight_decay, 0.0f);
    if ((r = mn__numel(dims, ndim, &n)) != MN_OK) return r;
    if (!mn__opt_in(q.lr, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta1, 0.0f, 1.0f, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.beta2, 0.0f, 1.0f, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.weight_decay, 0.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_dtype(&q.dtype)) != MN_OK) return r;
    if ((r = mn_lion_state_bytes(dims, ndim, &bytes)) != MN_OK) return r;
    s->alloc = mn__opt_allocator(alloc);
    if ((r = mn__opt_alloc(&s->alloc, bytes, &mem)) != MN_OK) {
        memset(s, 0, sizeof *s);
        return r;
    }
    s->params = q;
    s->n = n;
    s->exp_avg = (float *)mem;
    s->state_bytes = bytes;
    return MN_OK;
}

MNIMPL mn_result mn_lion_step(mn_lion *s, float *param, const float *grad, uint16_t *param16) {
    const mn_lion_params *p;
    float decay, lr, b1, b2;
    uint64_t i;
    mn_result r;
    if (!s) return MN_ERR_INVALID_ARG;
    if ((r = mn__opt_step_check(s->n, param, grad, s->params.dtype, param16)) != MN_OK) return r;
    p = &s->params;
    s->step++;
    lr = p->lr, b1 = p->beta1, b2 = p->beta2;
    decay = (float)(1.0 - (double)lr * (double)p->weight_decay);
    for (i = 0; i < s->n; i++) {
        float g = grad[i], m = s->exp_avg[i];
        float c = m * b1 + (1.0f - b1) * g;
        float sg = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
        param[i] = param[i] * decay - lr * sg;
        s->exp_avg[i] = m * b2 + (1.0f - b2) * g;
    }
    mn__opt_store16(p->dtype, param, param16, s->n);
    return MN_OK;
}

MNIMPL void mn_lion_free(mn_lion *s) {
    if (!s) return;
    mn__free(&s->alloc, s->exp_avg);
    memset(s, 0, sizeof *s);
}

// --- Gradient clipping ---------------------------------------------------------------------------
//
// torch.nn.utils.clip_grad_norm_: total = ‖(‖g_1‖_p, ..., ‖g_k‖_p)‖_p = (Σ|g|^p)^(1/p) over every
// element (max |g| for p = inf); coef = max_norm / (total + 1e-6) in fp32, clamped to at most 1;
// every gradient *= coef (also when coef is 1). The sum runs in double.

MNIMPL mn_result mn_clip_grad_norm(float *const *grads, const uint64_t *sizes, uint32_t count,
                                   float max_norm, float norm_type, float *total_norm) {
    double acc = 0.0, pn;
    float norm, coef;
    uint32_t k;
    uint64_t i;
    int inf_norm;
    if (count > 0 && (!grads || !sizes)) return MN_ERR_INVALID_ARG;
    if (!(max_norm >= 0.0f)) return MN_ERR_INVALID_ARG;  // also rejects NaN
    if (norm_type == 0.0f) norm_type = 2.0f;
    if (!(norm_type > 0.0f)) return MN_ERR_INVALID_ARG;
    for (k = 0; k < count; k++)
        if (!grads[k] && sizes[k] > 0) return MN_ERR_INVALID_ARG;
    inf_norm = !mn__opt_finite(norm_type);
    pn = (double)norm_type;
    for (k = 0; k < count; k++) {
        const float *g = grads[k];
        for (i = 0; i < sizes[k]; i++) {
            double a = fabs((double)g[i]);
            if (inf_norm) {
                if (a > acc || a != a) acc = a;  // a NaN sticks
            } else if (norm_type == 2.0f) {
                acc += a * a;
            } else if (norm_type == 1.0f) {
                acc += a;
            } else {
                acc += pow(a, pn);
            }
        }
    }
    if (inf_norm || norm_type == 1.0f) norm = (float)acc;
    else if (norm_type == 2.0f) norm = (float)sqrt(acc);
    else norm = (float)pow(acc, 1.0 / pn);
    if (total_norm) *total_norm = norm;
    coef = max_norm / (norm + 1e-6f);
    if (coef > 1.0f) coef = 1.0f;
    for (k = 0; k < count; k++)
        for (i = 0; i < sizes[k]; i++) grads[k][i] *= coef;
    return MN_OK;
}

// --- Dynamic loss scaling ------------------------------------------------------------------------
//
// torch.amp.GradScaler with aten/src/ATen/native/cuda/AmpKernels.cu (_amp_update_scale):
//   found_inf: scale ← scale · backoff, tracker ← 0, the optimizer step is skipped
//   else:      tracker + 1 == interval ? (scale ← scale · growth if finite, tracker ← 0)
//                                      : tracker += 1
// Unscale (_amp_foreach_non_finite_check_and_unscale_): g ← g · inv_scale in fp32, found_inf if any
// g is inf or NaN. The scale is fp32; products are formed in double and rounded, as the kernel
// does.

MNIMPL mn_result mn_loss_scaler_init(mn_loss_scaler *s, const mn_loss_scaler_params *p) {
    mn_loss_scaler_params q;
    if (!s) return MN_ERR_INVALID_ARG;
    memset(s, 0, sizeof *s);
    if (p) q = *p;
    else memset(&q, 0, sizeof q);
    if (q.init_scale == 0.0f) q.init_scale = 65536.0f;
    if (q.growth_factor == 0.0f) q.growth_factor = 2.0f;
    if (q.backoff_factor == 0.0f) q.backoff_factor = 0.5f;
    if (q.growth_interval == 0) q.growth_interval = 2000;
    if (!mn__opt_in(q.init_scale, FLT_MIN, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.growth_factor, 1.0f, FLT_MAX, 1)) return MN_ERR_INVALID_ARG;
    if (q.growth_factor == 1.0f) return MN_ERR_INVALID_ARG;
    if (!mn__opt_in(q.backoff_factor, FLT_MIN, 1.0f, 0)) return MN_ERR_INVALID_ARG;
    s->params = q;
    s->scale = q.init_scale;
    return MN_OK;
}

MNIMPL float mn_loss_scaler_inv_scale(const mn_loss_scaler *s) {
    return s ? (float)(1.0 / (double)s->scale) : 0.0f;
}

MNIMPL mn_result mn_loss_scaler_update(mn_loss_scaler *s, int found_inf, int *skip_step) {
    if (!s || s->params.growth_interval == 0) return MN_ERR_INVALID_ARG;
    s->steps++;
    if (found_inf) {
        s->scale = (float)((double)s->scale * (double)s->params.backoff_factor);
        s->growth_tracker = 0;
        s->skipped++;
    } else if (s->growth_tracker + 1 == s->params.growth_interval) {
        float grown = (float)((double)s->scale * (double)s->params.growth_factor);
        if (mn__opt_finite(grown)) s->scale = grown;
        s->growth_tracker = 0;
    } else {
        s->growth_tracker++;
    }
    if (skip_step) *skip_step = found_inf != 0;
    return MN_OK;
}

MNIMPL mn_result mn_unscale_grads(mn_dtype dtype, void *grad, uint64_t n, float inv_scale,
                                  int *found_inf) {
    uint64_t i;
    int bad = 0;
    if (dtype == MN_DTYPE_DEFAULT) dtype = MN_FP32;
    if (!found_inf || (n > 0 && !grad)) return MN_ERR_INVALID_ARG;
    if (dtype == MN_FP32) {
        float *g = (float *)grad;
        for (i = 0; i < n; i++) {
            bad |= !mn__opt_finite(g[i]);
            g[i] *= inv_scale;
        }
    } else if (dtype == MN_FP16) {
        uint16_t *g = (uint16_t *)grad;
        for (i = 0; i < n; i++) {
            bad |= (g[i] & 0x7c00u) == 0x7c00u;
            g[i] = mn_fp32_to_fp16(mn_fp16_to_fp32(g[i]) * inv_scale);
        }
    } else if (dtype == MN_BF16) {
        uint16_t *g = (uint16_t *)grad;
        for (i = 0; i < n; i++) {
            bad |= (g[i] & 0x7f80u) == 0x7f80u;
            g[i] = mn_fp32_to_bf16(mn_bf16_to_fp32(g[i]) * inv_scale);
        }
    } else {
        return MN_ERR_INVALID_ARG;
    }
    if (bad) *found_inf = 1;
    return MN_OK;
}

MNIMPL mn_result mn_unscale_grads_to_fp32(mn_dtype dtype, const void *src, float *dst, uint64_t n,
                                          float inv_scale, int *found_inf) {
    uint64_t i;
    int bad = 0;
    if (dtype == MN_DTYPE_DEFAULT) dtype = MN_FP32;
    if (!found_inf || (n > 0 && (!src || !dst))) return MN_ERR_INVALID_ARG;
    if (dtype != MN_FP32 && dtype != MN_FP16 && dtype != MN_BF16) return MN_ERR_INVALID_ARG;
    for (i = 0; i < n; i++) {
        float v = dtype == MN_FP32 ? ((const float *)src)[i]
                : dtype == MN_FP16 ? mn_fp16_to_fp32(((const uint16_t *)src)[i])
                                   : mn_bf16_to_fp32(((const uint16_t *)src)[i]);
        bad |= !mn__opt_finite(v);
        dst[i] = v * inv_scale;
    }
    if (bad) *found_inf = 1;
    return MN_OK;
}
