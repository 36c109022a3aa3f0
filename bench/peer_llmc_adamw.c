// The AdamW peer of bench_table: the update loop as llm.c writes it (train_gpt2.c,
// gpt2_update: bias-corrected m_hat and v_hat, eps added to sqrt(v_hat), weight decay folded into
// the update), compiled in this translation unit of its own with -O3 -ffast-math -march=native as
// llm.c builds it (its Makefile's -Ofast), so the row shows the speed a user of that loop gets.
// Fast-math lets the compiler replace the square root and the divisions with approximations:
// the results are close to memanat's, not the same bits (memanat's step is correctly rounded).
#include <math.h>
#include <stddef.h>

void peer_llmc_adamw(float *param, const float *grad, float *m_mem, float *v_mem, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int t);

void peer_llmc_adamw(float *param, const float *grad, float *m_mem, float *v_mem, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int t) {
    size_t i;
    for (i = 0; i < n; i++) {
        float w = param[i], g = grad[i];
        float m = beta1 * m_mem[i] + (1.0f - beta1) * g;       // first moment
        float v = beta2 * v_mem[i] + (1.0f - beta2) * g * g;   // second moment
        float m_hat = m / (1.0f - powf(beta1, (float)t));      // bias corrections
        float v_hat = v / (1.0f - powf(beta2, (float)t));
        m_mem[i] = m;
        v_mem[i] = v;
        param[i] = w - lr * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * w);
    }
}
