// >>optim implementation ------------------------------------------------------------------------
//
// State per parameter tensor of n elements (fp32 master):
//   SGD 0; SGD+momentum n*4 (momentum_buffer); AdamW n*8 (exp_avg, exp_avg_sq); Lion n*4 (exp_avg);
//   8-bit AdamW: n >= min_8bit_size -> 2 uint8 codes per element + one fp32 absmax per block for
//     each state, else 32-bit AdamW (bitsandbytes optim/optimizer.py, Optimizer8bit.init_state);
//   Adafactor (transformers optimization.py): ndim >= 2 -> row means (prod of dims[:-1]) + column
//     means (prod of dims[:-2] * dims[-1]) in fp32, ndim 1 -> full exp_avg_sq; + n*4 if beta1.

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

MNIMPL mn_result mn_sgd_state_bytes(const uint64_t *dims, uint32_t ndim, int momentum, uint64_t *out) {
    uint64_t n;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (!momentum) { *out = 0; return MN_OK; }
    return mn_mul_u64(n, 4, out);
}

MNIMPL mn_result mn_adamw_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out) {
    uint64_t n;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    return mn_mul_u64(n, 8, out);
}

MNIMPL mn_result mn_lion_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out) {
    uint64_t n;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    return mn_mul_u64(n, 4, out);
}

MNIMPL mn_result mn_adamw8bit_state_bytes(const uint64_t *dims, uint32_t ndim, uint32_t block_size,
                                          uint64_t min_8bit_size, uint64_t *out) {
    uint64_t n, blocks;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (block_size == 0) block_size = 256;
    if (min_8bit_size == 0) min_8bit_size = 4096;
    if (n < min_8bit_size) return mn_mul_u64(n, 8, out);
    blocks = n / block_size + (n % block_size != 0);
    // two uint8 states (n each) + two fp32 absmax arrays (blocks each); no overflow: n < 2^64/8
    if (n > UINT64_MAX / 4) return MN_ERR_OVERFLOW;
    *out = 2 * n + 8 * blocks;
    return MN_OK;
}

MNIMPL mn_result mn_adafactor_state_bytes(const uint64_t *dims, uint32_t ndim, int beta1, uint64_t *out) {
    uint64_t n, v, rows, cols, m = 0;
    mn_result r = mn__numel(dims, ndim, &n);
    if (r != MN_OK) return r;
    if (n > UINT64_MAX / 8) return MN_ERR_OVERFLOW;
    if (ndim >= 2) {
        rows = n / dims[ndim - 1];                  // prod(dims[:-1])
        cols = n / (dims[ndim - 2]);                // prod(dims[:-2]) * dims[-1]
        v = 4 * (rows + cols);
    } else {
        v = 4 * n;
    }
    if (beta1) m = 4 * n;
    *out = v + m;
    return MN_OK;
}

MNIMPL mn_result mn_optim_state_bytes(const mn_optim_desc *d, const uint64_t *dims, uint32_t ndim,
                                      uint64_t *out) {
    mn_optim kind = d ? d->kind : MN_OPTIM_DEFAULT;
    if (!out) return MN_ERR_INVALID_ARG;
    switch (kind) {
    case MN_OPTIM_DEFAULT:
    case MN_OPTIM_ADAMW: return mn_adamw_state_bytes(dims, ndim, out);
    case MN_OPTIM_ADAMW_8BIT:
        return mn_adamw8bit_state_bytes(dims, ndim, d ? d->block_size : 0, d ? d->min_8bit_size : 0, out);
    case MN_OPTIM_SGD: return mn_sgd_state_bytes(dims, ndim, 0, out);
    case MN_OPTIM_SGD_MOMENTUM: return mn_sgd_state_bytes(dims, ndim, 1, out);
    case MN_OPTIM_ADAFACTOR: return mn_adafactor_state_bytes(dims, ndim, d ? d->adafactor_beta1 : 0, out);
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
