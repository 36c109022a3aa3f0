// >>optim ---------------------------------------------------------------------------------------
//
// Optimizer state sizes. The estimator calls these same functions, so the state it predicts and
// the state an optimizer here allocates are one number.

typedef struct mn_optim_desc {
    mn_optim kind;            // 0 = adamw
    int adafactor_beta1;      // Adafactor keeps a first moment (beta1 set), 0 = no (transformers)
    uint32_t block_size;      // 8-bit: elements per absmax block, 0 = 256 (bitsandbytes blockwise)
    uint64_t min_8bit_size;   // 8-bit: tensors with fewer elements keep 32-bit state, 0 = 4096
} mn_optim_desc;

// Bytes of optimizer state kept for one parameter tensor of the given shape (dims[0..ndim-1],
// ndim 1..8, the last dimension the fastest), for 32-bit master parameters.
MNDEF mn_result mn_optim_state_bytes(const mn_optim_desc *d, const uint64_t *dims, uint32_t ndim,
                                     uint64_t *out);
MNDEF mn_result mn_sgd_state_bytes(const uint64_t *dims, uint32_t ndim, int momentum, uint64_t *out);
MNDEF mn_result mn_adamw_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out);
MNDEF mn_result mn_adamw8bit_state_bytes(const uint64_t *dims, uint32_t ndim, uint32_t block_size,
                                         uint64_t min_8bit_size, uint64_t *out);
MNDEF mn_result mn_adafactor_state_bytes(const uint64_t *dims, uint32_t ndim, int beta1, uint64_t *out);
MNDEF mn_result mn_lion_state_bytes(const uint64_t *dims, uint32_t ndim, uint64_t *out);
