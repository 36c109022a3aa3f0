// >>ops implementation --------------------------------------------------------------------------
//
// Row-major fp32 arrays, llm.c layout. Reductions use eight independent float lanes (vectorizable
// without -ffast-math, and closer to pairwise summation than one running sum).
// Matmul is a packed, register-tiled GEMM: a task computes a block of rows x columns of the
// output; within it the B operand is packed into KC x NR panels and the A operand into MR x KC
// tiles, and an MR x NR register tile accumulates. The summation order over k does not depend on
// the thread count, so results are bitwise identical with and without OpenMP.

#define MN__PRAGMA(x) _Pragma(#x)
#ifdef _OPENMP
#define MN__OMP_FOR_DYNAMIC MN__PRAGMA(omp parallel for schedule(dynamic, 1))
#define MN__OMP_FOR_IF(cond) MN__PRAGMA(omp parallel for schedule(static) if (cond))
#else
#define MN__OMP_FOR_DYNAMIC
#define MN__OMP_FOR_IF(cond)
#endif

// Small math helpers are inlined into every loop that uses them, which is what lets those loops
// vectorize (a call per element would not).
#if defined(__GNUC__) || defined(__clang__)
#define MN__INLINE static inline __attribute__((always_inline, unused))
#else
#define MN__INLINE static inline
#endif

// Elementwise loops go parallel above this many elements (below it the thread start costs more).
#define MN__OMP_MIN_ELEMS 32768

// Fused multiply-add where the hardware has it (one rounding), plain multiply-add elsewhere, so
// the tests do not call a libm fmaf emulation in their inner loops.
#ifdef __FMA__
#define MN__FMA(a, b, c) fmaf((a), (b), (c))
#else
#define MN__FMA(a, b, c) ((a) * (b) + (c))
#endif

// sum_i x[i] in eight lanes, folded in double.
MN__PRIVATE float mn__sum(const float *x, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    double s = 0.0;
    int i = 0, l;
    for (; i + 8 <= n; i += 8)
        for (l = 0; l < 8; l++) acc[l] += x[i + l];
    for (; i < n; i++) s += x[i];
    for (l = 0; l < 8; l++) s += acc[l];
    return (float)s;
}

// sum_i x[i] * y[i] in eight lanes, folded pairwise in float.
MN__PRIVATE float mn__dot(const float *x, const float *y, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, s = 0.0f;
    int i = 0, l;
    for (; i + 8 <= n; i += 8)
        for (l = 0; l < 8; l++) acc[l] = MN__FMA(x[i + l], y[i + l], acc[l]);
    for (; i < n; i++) s = MN__FMA(x[i], y[i], s);
    return s + (((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])));
}

// sum_i (x[i] - m)^2 in eight lanes, folded in double.
MN__PRIVATE float mn__sumsq_centered(const float *x, float m, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    double s = 0.0;
    int i = 0, l;
    for (; i + 8 <= n; i += 8)
        for (l = 0; l < 8; l++) {
            float d = x[i + l] - m;
            acc[l] = MN__FMA(d, d, acc[l]);
        }
    for (; i < n; i++) s += (double)(x[i] - m) * (x[i] - m);
    for (l = 0; l < 8; l++) s += acc[l];
    return (float)s;
}

// max_i scale x[i] in eight lanes (NaN entries are skipped here and propagate through exp later).
MN__PRIVATE float mn__max_scaled(const float *x, float scale, int n) {
    float acc[8], m = -INFINITY;
    int i = 0, l;
    for (l = 0; l < 8; l++) acc[l] = -INFINITY;
    for (; i + 8 <= n; i += 8)
        for (l = 0; l < 8; l++) acc[l] = scale * x[i + l] > acc[l] ? scale * x[i + l] : acc[l];
    for (; i < n; i++) m = scale * x[i] > m ? scale * x[i] : m;
    for (l = 0; l < 8; l++) m = acc[l] > m ? acc[l] : m;
    return m;
}

// exp(x) in plain arithmetic that vectorizes (libm's expf is a call per element): x = n ln2 + r
// with |r| <= ln2/2 (Cody & Waite 1980 two-constant reduction), exp(r) by its Taylor polynomial to
// r^7 (truncation < 5e-9 relative, so about 1 ulp overall), 2^n built from exponent bits in two
// halves so that gradual underflow and overflow to inf come out right. NaN stays NaN.
MN__INLINE float mn__expf(float x) {
    const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    float xc = x > -104.0f ? (x < 89.0f ? x : 89.0f) : -104.0f;
    float n = (xc * 1.44269504088896341f + round) - round;
    float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 +
              r * (1.0f / 720 + r * (1.0f / 5040)))))));
    int32_t ni = (int32_t)n, h = ni / 2;
    uint32_t b1 = (uint32_t)(h + 127) << 23, b2 = (uint32_t)(ni - h + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return x == x ? p * s1 * s2 : x;
}

// sum_i exp(x[i] - m) in eight lanes, folded in double.
MN__PRIVATE double mn__sumexp(const float *x, float m, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    double s = 0.0;
    int i = 0, l;
    for (; i + 8 <= n; i += 8)
        for (l = 0; l < 8; l++) acc[l] += mn__expf(x[i + l] - m);
    for (; i < n; i++) s += mn__expf(x[i] - m);
    for (l = 0; l < 8; l++) s += acc[l];
    return s;
}

// y[i] = exp(scale x[i] - m) and their sum (eight lanes, folded in double) in one pass.
MN__PRIVATE double mn__exp_store_sum(float *y, const float *x, float scale, float m, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    double s = 0.0;
    int i = 0, l;
    for (; i + 8 <= n; i += 8)
        for (l = 0; l < 8; l++) {
            y[i + l] = mn__expf(scale * x[i + l] - m);
            acc[l] += y[i + l];
        }
    for (; i < n; i++) {
        y[i] = mn__expf(scale * x[i] - m);
        s += y[i];
    }
    for (l = 0; l < 8; l++) s += acc[l];
    return s;
}

// ---- GEMM core --------------------------------------------------------------------------------
//
// c[m, j] += sum_k A(m, k) * B(k, j) for m < M, j < NC, k < K, where A(m, k) = a[m*a_rs + k*a_cs]
// and B(k, j) = b[k*b_rs + j*b_cs]. The three matmul products are this one loop nest with
// different strides.

// Register tile geometry. With GCC/clang vector extensions the tile is MR rows x two SIMD vectors
// (sized to the register file: 32 registers with AVX-512, 16 with AVX/SSE); plain C elsewhere.
#if (defined(__GNUC__) || defined(__clang__)) && !defined(MN_NO_SIMD)
#define MN__SIMD 1
#if defined(__AVX512F__)
#define MN__VW 16
#define MN__MR 8
#define MN__EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#elif defined(__AVX__)
#define MN__VW 8
#define MN__MR 6
#define MN__EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5)
#else
#define MN__VW 4
#define MN__MR 4
#define MN__EACH_ROW(X) X(0) X(1) X(2) X(3)
#endif
typedef float mn__vf __attribute__((vector_size(MN__VW * sizeof(float))));
#else
#define MN__SIMD 0
#define MN__VW 8
#define MN__MR 4
#endif
#define MN__NR (2 * MN__VW)  // columns of the register tile
#define MN__KC 256           // depth of a packed block
#define MN__JB 128           // columns per task (a multiple of MN__NR)
#define MN__MB 64            // rows per task (a multiple of MN__MR)

// GCC in ISO C mode does not contract a*b+c into one FMA; the register tile asks for it
// (clang contracts within an expression by default).
#if defined(__GNUC__) && !defined(__clang__)
#define MN__CONTRACT __attribute__((optimize("fp-contract=fast")))
#else
#define MN__CONTRACT
#endif

typedef struct mn__gemm {
    float *c;
    size_t ldc;
    const float *a;
    size_t a_rs, a_cs;
    const float *b;
    size_t b_rs, b_cs;
    int M, NC, K;
} mn__gemm;

// Register tile: acc = sum_k ap[k][0..MR) (outer) bp[k][0..NR), then c += acc on the valid part
// (mr rows, nr columns).
MN__PRIVATE MN__CONTRACT void mn__gemm_tile(float *c, size_t ldc, int mr, int nr, const float *ap,
                                            const float *bp, int kc) {
    float out[MN__MR][MN__NR];
    int k, m, j;
#if MN__SIMD
    mn__vf acc0[MN__MR], acc1[MN__MR], b0, b1, zero;
    memset(&zero, 0, sizeof zero);
    for (m = 0; m < MN__MR; m++) acc0[m] = zero, acc1[m] = zero;
    for (k = 0; k < kc; k++) {
        const float *av = ap + (size_t)k * MN__MR, *bv = bp + (size_t)k * MN__NR;
        memcpy(&b0, bv, sizeof b0);
        memcpy(&b1, bv + MN__VW, sizeof b1);
        // the row loop written out, so that -O2 keeps the accumulators in registers too
#define MN__ROW(m) acc0[m] += b0 * av[m], acc1[m] += b1 * av[m];
        MN__EACH_ROW(MN__ROW)
#undef MN__ROW
    }
    for (m = 0; m < MN__MR; m++) {
        memcpy(&out[m][0], &acc0[m], sizeof acc0[m]);
        memcpy(&out[m][MN__VW], &acc1[m], sizeof acc1[m]);
    }
#else
    for (m = 0; m < MN__MR; m++)
        for (j = 0; j < MN__NR; j++) out[m][j] = 0.0f;
    for (k = 0; k < kc; k++) {
        const float *av = ap + (size_t)k * MN__MR, *bv = bp + (size_t)k * MN__NR;
        for (m = 0; m < MN__MR; m++)
            for (j = 0; j < MN__NR; j++) out[m][j] += av[m] * bv[j];
    }
#endif
    if (mr == MN__MR && nr == MN__NR) {
        for (m = 0; m < MN__MR; m++)
            for (j = 0; j < MN__NR; j++) c[(size_t)m * ldc + j] += out[m][j];
    } else {
        for (m = 0; m < mr; m++)
            for (j = 0; j < nr; j++) c[(size_t)m * ldc + j] += out[m][j];
    }
}

// One task: rows [m0, m0+mb) x columns [j0, j0+jb) of c, all of k.
MN__PRIVATE void mn__gemm_task(const mn__gemm *g, int m0, int mb, int j0, int jb) {
    float bpack[MN__KC * MN__JB];
    float apack[MN__KC * MN__MR];
    int k0, kc, p, jj, k, m, i;
    int npanel = (jb + MN__NR - 1) / MN__NR;
    for (k0 = 0; k0 < g->K; k0 += MN__KC) {
        kc = g->K - k0 < MN__KC ? g->K - k0 : MN__KC;
        // pack B(k0.., j0..) as panels [p][k][NR], zero-padded past the last column
        for (p = 0; p < npanel; p++) {
            float *dst = bpack + (size_t)p * MN__KC * MN__NR;
            int jn = jb - p * MN__NR < MN__NR ? jb - p * MN__NR : MN__NR;
            const float *src = g->b + (size_t)k0 * g->b_rs + (size_t)(j0 + p * MN__NR) * g->b_cs;
            if (jn < MN__NR) memset(dst, 0, (size_t)kc * MN__NR * sizeof(float));
            if (g->b_cs == 1) {  // read along rows of B
                for (k = 0; k < kc; k++)
                    for (jj = 0; jj < jn; jj++)
                        dst[(size_t)k * MN__NR + jj] = src[(size_t)k * g->b_rs + jj];
            } else {             // read along columns of B (B is a transposed matrix)
                for (jj = 0; jj < jn; jj++)
                    for (k = 0; k < kc; k++)
                        dst[(size_t)k * MN__NR + jj] =
                            src[(size_t)jj * g->b_cs + (size_t)k * g->b_rs];
            }
        }
        for (i = 0; i < mb; i += MN__MR) {
            int mr = mb - i < MN__MR ? mb - i : MN__MR;
            // pack A(m0+i.., k0..) as [k][MR]; rows past the end repeat the last row (discarded)
            const float *src = g->a + (size_t)(m0 + i) * g->a_rs + (size_t)k0 * g->a_cs;
            if (g->a_cs == 1) {  // rows of A are contiguous
                for (m = 0; m < MN__MR; m++) {
                    const float *row = src + (size_t)(m < mr ? m : mr - 1) * g->a_rs;
                    for (k = 0; k < kc; k++) apack[(size_t)k * MN__MR + m] = row[k];
                }
            } else {             // columns of A are contiguous (A is a transposed matrix)
                for (k = 0; k < kc; k++)
                    for (m = 0; m < MN__MR; m++)
                        apack[(size_t)k * MN__MR + m] =
                            src[(size_t)k * g->a_cs + (size_t)(m < mr ? m : mr - 1) * g->a_rs];
            }
            for (p = 0; p < npanel; p++) {
                int jn = jb - p * MN__NR < MN__NR ? jb - p * MN__NR : MN__NR;
                float *c = g->c + (size_t)(m0 + i) * g->ldc + (size_t)(j0 + p * MN__NR);
                mn__gemm_tile(c, g->ldc, mr, jn, apack, bpack + (size_t)p * MN__KC * MN__NR, kc);
            }
        }
    }
}

// Runs every task; the tasks write disjoint blocks of c, so any schedule gives the same bits.
MN__PRIVATE void mn__gemm_run(const mn__gemm *g) {
    int mt = (g->M + MN__MB - 1) / MN__MB, jt = (g->NC + MN__JB - 1) / MN__JB;
    long t, ntask = (long)mt * jt;
    if (g->M <= 0 || g->NC <= 0 || g->K <= 0) return;
    MN__OMP_FOR_DYNAMIC
    for (t = 0; t < ntask; t++) {
        int m0 = (int)(t / jt) * MN__MB, j0 = (int)(t % jt) * MN__JB;
        int mb = g->M - m0 < MN__MB ? g->M - m0 : MN__MB;
        int jb = g->NC - j0 < MN__JB ? g->NC - j0 : MN__JB;
        mn__gemm_task(g, m0, mb, j0, jb);
    }
}

// The same tasks on the calling thread (for callers already inside a parallel loop).
MN__PRIVATE void mn__gemm_serial(const mn__gemm *g) {
    int m0, j0;
    for (m0 = 0; m0 < g->M; m0 += MN__MB)
        for (j0 = 0; j0 < g->NC; j0 += MN__JB)
            if (g->K > 0)
                mn__gemm_task(g, m0, g->M - m0 < MN__MB ? g->M - m0 : MN__MB, j0,
                              g->NC - j0 < MN__JB ? g->NC - j0 : MN__JB);
}

// c[M, NC] (row stride ldc) += A(m, k) B(k, j) with the strides of mn__gemm, on this thread.
MN__PRIVATE void mn__gemm_acc(float *c, size_t ldc, const float *a, size_t a_rs, size_t a_cs,
                              const float *b, size_t b_rs, size_t b_cs, int M, int NC, int K) {
    mn__gemm g;
    g.c = c, g.ldc = ldc, g.a = a, g.a_rs = a_rs, g.a_cs = a_cs;
    g.b = b, g.b_rs = b_rs, g.b_cs = b_cs, g.M = M, g.NC = NC, g.K = K;
    mn__gemm_serial(&g);
}

// ---- GELU ---------------------------------------------------------------------------------------

#define MN__GELU_S 0.7978845608028654f  // sqrt(2/pi)
#define MN__GELU_A 0.044715f

// GELU tanh approximation, Hendrycks & Gimpel 2016 (llm.c train_gpt2.c gelu_forward):
// 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3), evaluated as x sigmoid(2u) (the same
// function: 0.5 (1 + tanh u) = sigmoid(2u)) so that no 1 + tanh cancels for negative x.
MN__INLINE float mn__gelu(float x) {
    float u = MN__GELU_S * (x + MN__GELU_A * x * x * x);
    return x / (1.0f + mn__expf(-2.0f * u));
}

// d/dx of the above (llm.c gelu_backward): 0.5 (1 + tanh u) + 0.5 x sech^2(u) sqrt(2/pi)
// (1 + 3 a x^2), with s = sigmoid(2u): 0.5 (1 + tanh u) = s and sech^2(u) = 4 s (1 - s);
// 1 - s = sigmoid(-2u) is evaluated directly, not by a cancelling subtraction.
MN__INLINE float mn__gelu_grad(float x) {
    float u = MN__GELU_S * (x + MN__GELU_A * x * x * x);
    float s = 1.0f / (1.0f + mn__expf(-2.0f * u)), sm = 1.0f / (1.0f + mn__expf(2.0f * u));
    return s + 2.0f * x * s * sm * MN__GELU_S * (1.0f + 3.0f * MN__GELU_A * x * x);
}

// ---- matmul -------------------------------------------------------------------------------------

MNIMPL void mn_matmul_forward(float *out, float *pre_gelu, const float *inp, const float *weight,
                              const float *bias, int N, int C, int OC) {
    // y[n,o] = b[o] + sum_c x[n,c] w[o,c]; the GEMM runs into pre_gelu when the epilogue is on,
    // then out = gelu(pre_gelu) (cuBLASLt CUBLASLT_EPILOGUE_GELU_AUX_BIAS semantics).
    float *y = pre_gelu ? pre_gelu : out;
    mn__gemm g;
    long n;
    MN_ASSERT(out && inp && weight && N >= 0 && C >= 0 && OC >= 0);
    MN__OMP_FOR_IF((size_t)N * OC >= MN__OMP_MIN_ELEMS)
    for (n = 0; n < N; n++) {
        float *row = y + (size_t)n * OC;
        int o;
        if (bias) for (o = 0; o < OC; o++) row[o] = bias[o];
        else for (o = 0; o < OC; o++) row[o] = 0.0f;
    }
    g.c = y, g.ldc = (size_t)OC;
    g.a = inp, g.a_rs = (size_t)C, g.a_cs = 1;        // A(n, c) = inp[n, c]
    g.b = weight, g.b_rs = 1, g.b_cs = (size_t)C;     // B(c, o) = weight[o, c]
    g.M = N, g.NC = OC, g.K = C;
    mn__gemm_run(&g);
    if (pre_gelu) {
        MN__OMP_FOR_IF((size_t)N * OC >= MN__OMP_MIN_ELEMS)
        for (n = 0; n < N; n++) {
            int o;
            for (o = 0; o < OC; o++)
                out[(size_t)n * OC + o] = mn__gelu(pre_gelu[(size_t)n * OC + o]);
        }
    }
}

MNIMPL void mn_matmul_backward(float *dinp, float *dweight, float *dbias, float *dout,
                               const float *inp, const float *weight, const float *pre_gelu,
                               int N, int C, int OC) {
    // dpre = dout * gelu'(pre) (fused epilogue); dx[n,c] += sum_o dpre[n,o] w[o,c];
    // dw[o,c] += sum_n dpre[n,o] x[n,c]; db[o] += sum_n dpre[n,o] (llm.c matmul_backward).
    mn__gemm g;
    long n;
    MN_ASSERT(dout && N >= 0 && C >= 0 && OC >= 0);
    if (pre_gelu) {
        MN__OMP_FOR_IF((size_t)N * OC >= MN__OMP_MIN_ELEMS)
        for (n = 0; n < N; n++) {
            int o;
            for (o = 0; o < OC; o++)
                dout[(size_t)n * OC + o] *= mn__gelu_grad(pre_gelu[(size_t)n * OC + o]);
        }
    }
    if (dinp) {
        MN_ASSERT(weight);
        g.c = dinp, g.ldc = (size_t)C;
        g.a = dout, g.a_rs = (size_t)OC, g.a_cs = 1;      // A(n, o) = dpre[n, o]
        g.b = weight, g.b_rs = (size_t)C, g.b_cs = 1;     // B(o, c) = weight[o, c]
        g.M = N, g.NC = C, g.K = OC;
        mn__gemm_run(&g);
    }
    if (dweight) {
        MN_ASSERT(inp);
        g.c = dweight, g.ldc = (size_t)C;
        g.a = dout, g.a_rs = 1, g.a_cs = (size_t)OC;      // A(o, n) = dpre[n, o]
        g.b = inp, g.b_rs = (size_t)C, g.b_cs = 1;        // B(n, c) = inp[n, c]
        g.M = OC, g.NC = C, g.K = N;
        mn__gemm_run(&g);
    }
    if (dbias) {
        // columns in blocks of 64 per thread; each block sums the rows in order
        long blk, nblk = ((long)OC + 63) / 64;
        MN__OMP_FOR_IF((size_t)N * OC >= MN__OMP_MIN_ELEMS)
        for (blk = 0; blk < nblk; blk++) {
            int o0 = (int)blk * 64, o1 = o0 + 64 < OC ? o0 + 64 : OC, o, r;
            float acc[64];
            for (o = o0; o < o1; o++) acc[o - o0] = 0.0f;
            for (r = 0; r < N; r++) {
                const float *row = dout + (size_t)r * OC;
                for (o = o0; o < o1; o++) acc[o - o0] += row[o];
            }
            for (o = o0; o < o1; o++) dbias[o] += acc[o - o0];
        }
    }
}

// ---- layernorm / RMSNorm -----------------------------------------------------------------------

MNIMPL void mn_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                 const float *weight, const float *bias, int N, int C, float eps) {
    // mu = mean(x), var = mean((x - mu)^2) (biased), r = 1/sqrt(var + eps);
    // y = (x - mu) r w + b (llm.c train_gpt2.c layernorm_forward; two-pass variance).
    long n;
    MN_ASSERT(out && inp && weight && N >= 0 && C > 0);
    MN__OMP_FOR_IF((size_t)N * C >= MN__OMP_MIN_ELEMS)
    for (n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *y = out + (size_t)n * C;
        float m = mn__sum(x, C) / (float)C;
        float v = mn__sumsq_centered(x, m, C) / (float)C;
        float s = 1.0f / sqrtf(v + eps);
        int i;
        if (bias) for (i = 0; i < C; i++) y[i] = (x[i] - m) * s * weight[i] + bias[i];
        else for (i = 0; i < C; i++) y[i] = (x[i] - m) * s * weight[i];
        if (mean) mean[n] = m;
        if (rstd) rstd[n] = s;
    }
}

MNIMPL void mn_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                  const float *inp, const float *weight, const float *mean,
                                  const float *rstd, int N, int C) {
    // xh = (x - mu) r, g = w dy; dx += r (g - mean(g) - xh mean(g xh));
    // dw += sum_n dy xh, db += sum_n dy (llm.c train_gpt2.c layernorm_backward).
    long n, blk, nblk = ((long)C + 63) / 64;
    MN_ASSERT(dout && inp && mean && rstd && N >= 0 && C > 0);
    if (dinp) {
        MN_ASSERT(weight);
        MN__OMP_FOR_IF((size_t)N * C >= MN__OMP_MIN_ELEMS)
        for (n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float m = mean[n], r = rstd[n];
            double sg = 0.0, sgx = 0.0;
            float gm, gxm;
            int i;
            for (i = 0; i < C; i++) {
                float g = weight[i] * dy[i];
                sg += g;
                sgx += (double)g * ((x[i] - m) * r);
            }
            gm = (float)(sg / C), gxm = (float)(sgx / C);
            for (i = 0; i < C; i++) {
                float g = weight[i] * dy[i], xh = (x[i] - m) * r;  // g rounded as in the sums
                dx[i] += r * (g - gm - xh * gxm);
            }
        }
    }
    if (!dweight && !dbias) return;
    // parameter gradients: columns in blocks of 64 per thread, rows summed in order
    MN__OMP_FOR_IF((size_t)N * C >= MN__OMP_MIN_ELEMS)
    for (blk = 0; blk < nblk; blk++) {
        int c0 = (int)blk * 64, c1 = c0 + 64 < C ? c0 + 64 : C, i, r;
        float aw[64], ab[64];
        for (i = c0; i < c1; i++) aw[i - c0] = 0.0f, ab[i - c0] = 0.0f;
        for (r = 0; r < N; r++) {
            const float *x = inp + (size_t)r * C, *dy = dout + (size_t)r * C;
            float m = mean[r], s = rstd[r];
            for (i = c0; i < c1; i++) {
                aw[i - c0] += dy[i] * ((x[i] - m) * s);
                ab[i - c0] += dy[i];
            }
        }
        for (i = c0; i < c1; i++) {
            if (dweight) dweight[i] += aw[i - c0];
            if (dbias) dbias[i] += ab[i - c0];
        }
    }
}

MNIMPL void mn_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                               int N, int C, float eps) {
    // r = 1/sqrt(mean(x^2) + eps); y = x r w (Zhang & Sennrich 2019, "Root Mean Square Layer
    // Normalization", eq. 4; as in LLaMA's RMSNorm).
    long n;
    MN_ASSERT(out && inp && weight && N >= 0 && C > 0);
    MN__OMP_FOR_IF((size_t)N * C >= MN__OMP_MIN_ELEMS)
    for (n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *y = out + (size_t)n * C;
        float s = 1.0f / sqrtf(mn__dot(x, x, C) / (float)C + eps);
        int i;
        for (i = 0; i < C; i++) y[i] = x[i] * s * weight[i];
        if (rstd) rstd[n] = s;
    }
}

MNIMPL void mn_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                                const float *weight, const float *rstd, int N, int C) {
    // xh = x r, g = w dy; dx += r (g - xh mean(g xh)); dw += sum_n dy xh
    // (the layernorm backward without the mean terms; derivation in Zhang & Sennrich 2019).
    long n, blk, nblk = ((long)C + 63) / 64;
    MN_ASSERT(dout && inp && rstd && N >= 0 && C > 0);
    if (dinp) {
        MN_ASSERT(weight);
        MN__OMP_FOR_IF((size_t)N * C >= MN__OMP_MIN_ELEMS)
        for (n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float r = rstd[n], gxm;
            double sgx = 0.0;
            int i;
            for (i = 0; i < C; i++) sgx += (double)(weight[i] * dy[i]) * (x[i] * r);
            gxm = (float)(sgx / C);
            for (i = 0; i < C; i++) {
                float g = weight[i] * dy[i];
                dx[i] += r * (g - (x[i] * r) * gxm);
            }
        }
    }
    if (!dweight) return;
    MN__OMP_FOR_IF((size_t)N * C >= MN__OMP_MIN_ELEMS)
    for (blk = 0; blk < nblk; blk++) {
        int c0 = (int)blk * 64, c1 = c0 + 64 < C ? c0 + 64 : C, i, r;
        float aw[64];
        for (i = c0; i < c1; i++) aw[i - c0] = 0.0f;
        for (r = 0; r < N; r++) {
            const float *x = inp + (size_t)r * C, *dy = dout + (size_t)r * C;
            float s = rstd[r];
            for (i = c0; i < c1; i++) aw[i - c0] += dy[i] * (x[i] * s);
        }
        for (i = c0; i < c1; i++) dweight[i] += aw[i - c0];
    }
}

// ---- softmax ------------------------------------------------------------------------------------

MNIMPL void mn_softmax_forward(float *out, const float *inp, int N, int L, float scale, int causal) {
    // z = scale x; p_j = exp(z_j - max z) / sum_k exp(z_k - max z) over the unmasked j
    // (max subtracted for range safety; llm.c train_gpt2.c attention_forward / softmax_forward).
    long n;
    MN_ASSERT(out && inp && N >= 0 && L > 0);
    MN__OMP_FOR_IF((size_t)N * L >= MN__OMP_MIN_ELEMS)
    for (n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * L;
        float *y = out + (size_t)n * L;
        int len = causal ? (int)(n % L) + 1 : L, j;
        float mx = mn__max_scaled(x, scale, len), inv;
        inv = (float)(1.0 / mn__exp_store_sum(y, x, scale, mx, len));
        for (j = 0; j < len; j++) y[j] *= inv;
        for (; j < L; j++) y[j] = 0.0f;
    }
}

MNIMPL void mn_softmax_backward(float *dinp, const float *dout, const float *out, int N, int L,
                                float scale, int causal) {
    // dz_j = p_j (dy_j - sum_k p_k dy_k); dx_j += scale dz_j (softmax Jacobian diag(p) - p p^T).
    long n;
    MN_ASSERT(dinp && dout && out && N >= 0 && L > 0);
    MN__OMP_FOR_IF((size_t)N * L >= MN__OMP_MIN_ELEMS)
    for (n = 0; n < N; n++) {
        const float *p = out + (size_t)n * L, *dy = dout + (size_t)n * L;
        float *dx = dinp + (size_t)n * L;
        int len = causal ? (int)(n % L) + 1 : L, j;
        float d = mn__dot(p, dy, len);
        for (j = 0; j < len; j++) dx[j] += scale * (p[j] * (dy[j] - d));
    }
}

// ---- attention ----------------------------------------------------------------------------------
//
// Per (b, h) and query t: s_j = q_t . k_j / sqrt(hs) over the visible keys j, p = softmax(s),
// out_t = sum_j p_j v_j (Vaswani et al. 2017). Backward in the FlashAttention form (Dao et al.
// 2022, algorithm 4): dp_j = dout_t . v_j, D_t = sum_j p_j dp_j, ds_j = p_j (dp_j - D_t);
// dq_t += ds_j k_j / sqrt(hs), dk_j += ds_j q_t / sqrt(hs), dv_j += p_j dout_t.
// The work is tiled: MN__AQ queries x MN__AK keys of scores live in a stack tile, never a T x T
// matrix, and every product is a small GEMM on the register-tiled core. Row statistics (max and
// 1/sum) come from one pass over the key tiles with the running-max rescaling of online softmax
// (Milakov & Gimelshein 2018); the probabilities from a second pass. Forward and backward build
// every score and probability with the same code in the same order, so probabilities kept by the
// forward and recomputed by the backward are the same floats. Threads own (b, h) pairs, whose
// gradient slices are disjoint.

#define MN__AQ 32  // queries per tile
#define MN__AK 64  // keys per tile

typedef struct mn__att {
    const float *q, *k, *v;  // this (b, h): position t of each at + t * stride
    const float *dout;       // [T, C] rows of this b, offset to head h (backward only)
    size_t stride, dstride;  // 3C, C
    int T, hs, causal;
    float scale;             // 1/sqrt(hs)
} mn__att;

// Keys visible to query t0 + i within the key tile starting at j0 (of nk keys).
MN__PRIVATE int mn__att_visible(const mn__att *a, int t0, int i, int j0, int nk) {
    int lim = t0 + i + 1 - j0;
    return !a->causal || lim > nk ? nk : (lim > 0 ? lim : 0);
}

// out[i][j] = x_{t0+i} . y_{j0+j} over hs channels, for i < nq, j < nk (0 past nk): a small
// GEMM, x rows at x + t * xs, y rows at y + j * ys.
MN__PRIVATE void mn__att_dots(const float *x, size_t xs, int t0, int nq, const float *y, size_t ys,
                              int j0, int nk, int hs, float out[MN__AQ][MN__AK]) {
    int i, j;
    for (i = 0; i < nq; i++)
        for (j = 0; j < MN__AK; j++) out[i][j] = 0.0f;
    mn__gemm_acc(&out[0][0], MN__AK, x + (size_t)t0 * xs, xs, 1, y + (size_t)j0 * ys, 1, ys, nq, nk,
                 hs);
}

// Scores of a tile: s[i][j] = scale q_{t0+i} . k_{j0+j}.
MN__PRIVATE void mn__att_scores(const mn__att *a, int t0, int nq, int j0, int nk,
                                float s[MN__AQ][MN__AK]) {
    int i, j;
    mn__att_dots(a->q, a->stride, t0, nq, a->k, a->stride, j0, nk, a->hs, s);
    for (i = 0; i < nq; i++)
        for (j = 0; j < MN__AK; j++) s[i][j] *= a->scale;
}

// Last key (exclusive) any query of the tile [t0, t0+nq) sees.
MN__PRIVATE int mn__att_kend(const mn__att *a, int t0, int nq) { return a->causal ? t0 + nq : a->T; }

// Row statistics of the query tile: mx[i] = max_j s_ij, inv[i] = 1 / sum_j exp(s_ij - mx[i]).
MN__PRIVATE void mn__att_stats(const mn__att *a, int t0, int nq, float *mx, float *inv) {
    float s[MN__AQ][MN__AK];
    double l[MN__AQ];
    int i, j, j0, nk, kend = mn__att_kend(a, t0, nq);
    for (i = 0; i < nq; i++) mx[i] = -INFINITY, l[i] = 0.0;
    for (j0 = 0; j0 < kend; j0 += MN__AK) {
        nk = kend - j0 < MN__AK ? kend - j0 : MN__AK;
        mn__att_scores(a, t0, nq, j0, nk, s);
        for (i = 0; i < nq; i++) {
            int vis = mn__att_visible(a, t0, i, j0, nk);
            float bm = -INFINITY;
            if (vis == 0) continue;
            for (j = 0; j < vis; j++) bm = s[i][j] > bm ? s[i][j] : bm;
            if (bm > mx[i]) {
                if (l[i] > 0.0) l[i] *= mn__expf(mx[i] - bm);
                mx[i] = bm;
            }
            l[i] += mn__sumexp(s[i], mx[i], vis);
        }
    }
    for (i = 0; i < nq; i++) inv[i] = (float)(1.0 / l[i]);
}

// Probabilities of a tile: p[i][j] for visible keys, 0 for masked ones and the padding.
MN__PRIVATE void mn__att_probs(const mn__att *a, int t0, int nq, int j0, int nk, const float *mx,
                               const float *inv, float p[MN__AQ][MN__AK]) {
    int i, j;
    mn__att_scores(a, t0, nq, j0, nk, p);
    for (i = 0; i < nq; i++) {
        int vis = mn__att_visible(a, t0, i, j0, nk);
        float m = mx[i], iv = inv[i], *row = p[i];
        for (j = 0; j < vis; j++) row[j] = mn__expf(row[j] - m) * iv;
        for (; j < MN__AK; j++) row[j] = 0.0f;
    }
}

// The same tile read back from the kept probabilities att [T, T] of this (b, h).
MN__PRIVATE void mn__att_probs_kept(const float *att, int T, int t0, int nq, int j0, int nk,
                                    float p[MN__AQ][MN__AK]) {
    int i, j;
    for (i = 0; i < nq; i++) {
        const float *row = att + (size_t)(t0 + i) * T + j0;
        for (j = 0; j < nk; j++) p[i][j] = row[j];
        for (; j < MN__AK; j++) p[i][j] = 0.0f;
    }
}

MN__PRIVATE void mn__att_forward_bh(const mn__att *a, float *out, size_t os,
                                                 float *att) {
    float p[MN__AQ][MN__AK], mx[MN__AQ], inv[MN__AQ];
    int t0, nq, j0, nk, i, j, d, kend;
    for (t0 = 0; t0 < a->T; t0 += MN__AQ) {
        nq = a->T - t0 < MN__AQ ? a->T - t0 : MN__AQ;
        kend = mn__att_kend(a, t0, nq);
        mn__att_stats(a, t0, nq, mx, inv);
        for (i = 0; i < nq; i++)
            for (d = 0; d < a->hs; d++) out[(size_t)(t0 + i) * os + d] = 0.0f;
        for (j0 = 0; j0 < kend; j0 += MN__AK) {
            nk = kend - j0 < MN__AK ? kend - j0 : MN__AK;
            mn__att_probs(a, t0, nq, j0, nk, mx, inv, p);
            if (att)
                for (i = 0; i < nq; i++)
                    memcpy(att + (size_t)(t0 + i) * a->T + j0, p[i], (size_t)nk * sizeof(float));
            // out_tile += p v_tile
            mn__gemm_acc(out + (size_t)t0 * os, os, &p[0][0], MN__AK, 1,
                         a->v + (size_t)j0 * a->stride, a->stride, 1, nq, a->hs, nk);
        }
        if (att)  // keys no query of this tile sees
            for (i = 0; i < nq; i++)
                for (j = kend; j < a->T; j++) att[(size_t)(t0 + i) * a->T + j] = 0.0f;
    }
}

MN__PRIVATE void mn__att_backward_bh(const mn__att *a, float *dq, float *dk, float *dv,
                                                  const float *att) {
    float p[MN__AQ][MN__AK], dp[MN__AQ][MN__AK], mx[MN__AQ], inv[MN__AQ], D[MN__AQ];
    int t0, nq, j0, nk, i, j, kend, pass;
    for (t0 = 0; t0 < a->T; t0 += MN__AQ) {
        nq = a->T - t0 < MN__AQ ? a->T - t0 : MN__AQ;
        kend = mn__att_kend(a, t0, nq);
        if (!att) mn__att_stats(a, t0, nq, mx, inv);
        for (i = 0; i < nq; i++) D[i] = 0.0f;
        // pass 0: D_i = sum_j p_ij dp_ij; pass 1: the gradients
        for (pass = 0; pass < 2; pass++) {
            for (j0 = 0; j0 < kend; j0 += MN__AK) {
                nk = kend - j0 < MN__AK ? kend - j0 : MN__AK;
                if (att) mn__att_probs_kept(att, a->T, t0, nq, j0, nk, p);
                else mn__att_probs(a, t0, nq, j0, nk, mx, inv, p);
                mn__att_dots(a->dout, a->dstride, t0, nq, a->v, a->stride, j0, nk, a->hs, dp);
                if (pass == 0) {
                    for (i = 0; i < nq; i++)
                        for (j = 0; j < nk; j++) D[i] += p[i][j] * dp[i][j];
                    continue;
                }
                // dp becomes ds = p (dp - D) / sqrt(hs); masked entries have p = 0, so ds = 0
                for (i = 0; i < nq; i++)
                    for (j = 0; j < nk; j++) dp[i][j] = p[i][j] * (dp[i][j] - D[i]) * a->scale;
                // dq_tile += ds k_tile / dk_tile += ds^T q_tile / dv_tile += p^T dout_tile
                mn__gemm_acc(dq + (size_t)t0 * a->stride, a->stride, &dp[0][0], MN__AK, 1,
                             a->k + (size_t)j0 * a->stride, a->stride, 1, nq, a->hs, nk);
                mn__gemm_acc(dk + (size_t)j0 * a->stride, a->stride, &dp[0][0], 1, MN__AK,
                             a->q + (size_t)t0 * a->stride, a->stride, 1, nk, a->hs, nq);
                mn__gemm_acc(dv + (size_t)j0 * a->stride, a->stride, &p[0][0], 1, MN__AK,
                             a->dout + (size_t)t0 * a->dstride, a->dstride, 1, nk, a->hs, nq);
            }
        }
    }
}

MN__PRIVATE void mn__att_setup(mn__att *a, const float *qkv, const float *dout, int b, int h,
                               int T, int C, int NH, int causal) {
    int hs = C / NH;
    const float *base = qkv + (size_t)b * T * 3 * C + (size_t)h * hs;
    a->q = base, a->k = base + C, a->v = base + 2 * (size_t)C;
    a->dout = dout ? dout + (size_t)b * T * C + (size_t)h * hs : NULL;
    a->stride = (size_t)3 * C, a->dstride = (size_t)C;
    a->T = T, a->hs = hs, a->causal = causal;
    a->scale = 1.0f / sqrtf((float)hs);
}

MNIMPL void mn_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C,
                                 int NH, int causal) {
    long bh;
    MN_ASSERT(out && qkv && B >= 0 && T >= 0 && NH > 0 && C % NH == 0);
    MN__OMP_FOR_IF((size_t)B * NH > 1)
    for (bh = 0; bh < (long)B * NH; bh++) {
        int b = (int)(bh / NH), h = (int)(bh % NH);
        mn__att a;
        mn__att_setup(&a, qkv, NULL, b, h, T, C, NH, causal);
        mn__att_forward_bh(&a, out + (size_t)b * T * C + (size_t)h * a.hs, (size_t)C,
                           att ? att + (size_t)bh * T * T : NULL);
    }
}

MNIMPL void mn_attention_backward(float *dqkv, const float *dout, const float *qkv,
                                  const float *att, int B, int T, int C, int NH, int causal) {
    long bh;
    MN_ASSERT(dqkv && dout && qkv && B >= 0 && T >= 0 && NH > 0 && C % NH == 0);
    MN__OMP_FOR_IF((size_t)B * NH > 1)
    for (bh = 0; bh < (long)B * NH; bh++) {
        int b = (int)(bh / NH), h = (int)(bh % NH);
        float *dbase = dqkv + (size_t)b * T * 3 * C;
        mn__att a;
        mn__att_setup(&a, qkv, dout, b, h, T, C, NH, causal);
        mn__att_backward_bh(&a, dbase + (size_t)h * a.hs, dbase + C + (size_t)h * a.hs,
                            dbase + 2 * (size_t)C + (size_t)h * a.hs,
                            att ? att + (size_t)bh * T * T : NULL);
    }
}

// ---- elementwise --------------------------------------------------------------------------------

MNIMPL void mn_gelu_forward(float *out, const float *inp, size_t n) {
    // y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), Hendrycks & Gimpel 2016
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) out[i] = mn__gelu(inp[i]);
}

MNIMPL void mn_gelu_backward(float *dinp, const float *dout, const float *inp, size_t n) {
    // dx += dy (0.5 (1 + tanh u) + 0.5 x sech^2(u) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) dinp[i] += dout[i] * mn__gelu_grad(inp[i]);
}

MNIMPL void mn_gelu_erf_forward(float *out, const float *inp, size_t n) {
    // y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), Hendrycks & Gimpel 2016 (exact GELU); written
    // with erfc(-x / sqrt 2) = 1 + erf(x / sqrt 2), which does not cancel for negative x
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) out[i] = 0.5f * inp[i] * erfcf(-inp[i] * 0.70710678118654752f);
}

MNIMPL void mn_gelu_erf_backward(float *dinp, const float *dout, const float *inp, size_t n) {
    // dy/dx = Phi(x) + x phi(x) = 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) {
        float x = inp[i];
        float g = 0.5f * erfcf(-x * 0.70710678118654752f) +
                  x * mn__expf(-0.5f * x * x) * 0.39894228040143268f;
        dinp[i] += dout[i] * g;
    }
}

// sigmoid(x) = 1 / (1 + exp(-x)); exp(-x) = inf for very negative x gives 0 as it should.
MN__INLINE float mn__sigmoid(float x) { return 1.0f / (1.0f + mn__expf(-x)); }

MNIMPL void mn_silu_forward(float *out, const float *inp, size_t n) {
    // y = x sigmoid(x), Elfwing et al. 2018
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) out[i] = inp[i] * mn__sigmoid(inp[i]);
}

MNIMPL void mn_silu_backward(float *dinp, const float *dout, const float *inp, size_t n) {
    // dy/dx = s (1 + x (1 - s)), s = sigmoid(x), 1 - s = sigmoid(-x)
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) {
        float x = inp[i], s = mn__sigmoid(x), sm = mn__sigmoid(-x);
        dinp[i] += dout[i] * (s + x * s * sm);
    }
}

MNIMPL void mn_swiglu_forward(float *out, const float *gate, const float *up, size_t n) {
    // y = silu(g) u, Shazeer 2020 (SwiGLU with the projections done by the caller's matmuls)
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) out[i] = gate[i] * mn__sigmoid(gate[i]) * up[i];
}

MNIMPL void mn_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
                               const float *up, size_t n) {
    // dg += dy u silu'(g); du += dy silu(g)
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) {
        float g = gate[i], s = mn__sigmoid(g), sm = mn__sigmoid(-g);
        if (dgate) dgate[i] += dout[i] * up[i] * (s + g * s * sm);
        if (dup) dup[i] += dout[i] * (g * s);
    }
}

MNIMPL void mn_residual_forward(float *out, const float *a, const float *b, size_t n) {
    // y = a + b (llm.c train_gpt2.c residual_forward)
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) out[i] = a[i] + b[i];
}

MNIMPL void mn_residual_backward(float *da, float *db, const float *dout, size_t n) {
    // da += dy, db += dy
    long i;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (i = 0; i < (long)n; i++) {
        if (da) da[i] += dout[i];
        if (db) db[i] += dout[i];
    }
}

// ---- embedding ----------------------------------------------------------------------------------

MN__PRIVATE int mn__ids_valid(const int *ids, size_t n, int V, int allow_negative) {
    size_t i;
    for (i = 0; i < n; i++) {
        if (ids[i] >= V) return 0;
        if (ids[i] < 0 && !allow_negative) return 0;
    }
    return 1;
}

MNIMPL mn_result mn_embedding_forward(float *out, const int *tokens, const float *wte,
                                      const float *wpe, int B, int T, int C, int V) {
    // y[b,t,:] = wte[tok[b,t],:] + wpe[t,:] (llm.c train_gpt2.c encoder_forward)
    long n;
    if (!out || !tokens || !wte || B < 0 || T < 0 || C < 0 || V <= 0) return MN_ERR_INVALID_ARG;
    if (!mn__ids_valid(tokens, (size_t)B * T, V, 0)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_IF((size_t)B * T * C >= MN__OMP_MIN_ELEMS)
    for (n = 0; n < (long)B * T; n++) {
        float *y = out + (size_t)n * C;
        const float *e = wte + (size_t)tokens[n] * C;
        const float *pe = wpe ? wpe + (size_t)(n % T) * C : NULL;
        int i;
        if (pe) for (i = 0; i < C; i++) y[i] = e[i] + pe[i];
        else for (i = 0; i < C; i++) y[i] = e[i];
    }
    return MN_OK;
}

MNIMPL mn_result mn_embedding_backward(float *dwte, float *dwpe, const float *dout,
                                       const int *tokens, int B, int T, int C, int V) {
    // dwte[tok[b,t],:] += dy[b,t,:]; dwpe[t,:] += dy[b,t,:] (llm.c encoder_backward). Threads
    // own column blocks, so repeated tokens never race and the sum order is fixed.
    long blk, nblk = ((long)C + 63) / 64;
    if (!dout || !tokens || B < 0 || T < 0 || C < 0 || V <= 0) return MN_ERR_INVALID_ARG;
    if (!mn__ids_valid(tokens, (size_t)B * T, V, 0)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_IF((size_t)B * T * C >= MN__OMP_MIN_ELEMS)
    for (blk = 0; blk < nblk; blk++) {
        int c0 = (int)blk * 64, c1 = c0 + 64 < C ? c0 + 64 : C, i;
        size_t n;
        for (n = 0; n < (size_t)B * T; n++) {
            const float *dy = dout + n * C;
            if (dwte) {
                float *dw = dwte + (size_t)tokens[n] * C;
                for (i = c0; i < c1; i++) dw[i] += dy[i];
            }
            if (dwpe) {
                float *dp = dwpe + (n % (size_t)T) * C;
                for (i = c0; i < c1; i++) dp[i] += dy[i];
            }
        }
    }
    return MN_OK;
}

// ---- cross-entropy ------------------------------------------------------------------------------

// Softmax statistics of a row of logits: max and log sum exp(x - max).
MN__PRIVATE void mn__logsumexp(const float *x, int V, float *mx, double *lse) {
    *mx = mn__max_scaled(x, 1.0f, V);
    *lse = log(mn__sumexp(x, *mx, V));
}

MNIMPL mn_result mn_crossentropy_forward(float *losses, float *probs, const float *logits,
                                         const int *targets, int N, int V) {
    // loss = logsumexp(x) - x[y]; p = exp(x - logsumexp(x)) (llm.c crossentropy_forward over
    // softmax_forward, fused as in llm.c fused_classifier)
    long n;
    if (!losses || !logits || !targets || N < 0 || V <= 0) return MN_ERR_INVALID_ARG;
    if (!mn__ids_valid(targets, (size_t)N, V, 1)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_IF((size_t)N * V >= MN__OMP_MIN_ELEMS)
    for (n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * V;
        float mx;
        double lse;
        int j;
        mn__logsumexp(x, V, &mx, &lse);
        losses[n] = targets[n] < 0 ? 0.0f : (float)(lse - (x[targets[n]] - mx));
        if (probs)
            for (j = 0; j < V; j++) probs[(size_t)n * V + j] = mn__expf((x[j] - mx) - (float)lse);
    }
    return MN_OK;
}

MNIMPL mn_result mn_crossentropy_backward(float *dlogits, const float *dlosses, const float *probs,
                                          const float *logits, const int *targets, int N, int V) {
    // dx_j += (p_j - [j == y]) dloss (llm.c crossentropy_softmax_backward)
    long n;
    if (!dlogits || !dlosses || !targets || N < 0 || V <= 0) return MN_ERR_INVALID_ARG;
    if (!probs && !logits) return MN_ERR_INVALID_ARG;
    if (!mn__ids_valid(targets, (size_t)N, V, 1)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_IF((size_t)N * V >= MN__OMP_MIN_ELEMS)
    for (n = 0; n < N; n++) {
        float *dx = dlogits + (size_t)n * V, d = dlosses[n];
        int j, y = targets[n];
        if (y < 0) continue;
        if (probs) {
            const float *p = probs + (size_t)n * V;
            for (j = 0; j < V; j++) dx[j] += p[j] * d;
        } else {
            const float *x = logits + (size_t)n * V;
            float mx;
            double lse;
            mn__logsumexp(x, V, &mx, &lse);
            for (j = 0; j < V; j++) dx[j] += mn__expf((x[j] - mx) - (float)lse) * d;
        }
        dx[y] -= d;
    }
    return MN_OK;
}

// ---- dropout ------------------------------------------------------------------------------------

MNIMPL void mn_philox4x32(const uint32_t ctr[4], uint64_t key, uint32_t out[4]) {
    // Philox-4x32-10, Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers: as easy as
    // 1, 2, 3" (Random123 philox4x32round): multipliers 0xD2511F53, 0xCD9E8D57, Weyl key
    // increments 0x9E3779B9, 0xBB67AE85.
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    int r;
    for (r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c0 = n0, c1 = (uint32_t)p1, c2 = n2, c3 = (uint32_t)p0;
        k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

#define MN__DROP_CHUNK 4096

MN__PRIVATE int mn__dropout_p_valid(float p) { return p >= 0.0f && p <= 1.0f; }

// keep[i] = 1 when element e = first + i (i < n) survives: word e % 4 of Philox(counter e / 4,
// key seed), read as a uniform in [0, 1), is below 1 - p.
MN__PRIVATE void mn__dropout_keep(uint8_t *keep, size_t n, float p, uint64_t seed, uint64_t first) {
    double thr = (1.0 - (double)p) * 4294967296.0;
    uint32_t ctr[4], word[4] = {0, 0, 0, 0};
    uint64_t e, blk = UINT64_MAX;
    size_t i;
    for (i = 0; i < n; i++) {
        e = first + i;
        if (e / 4 != blk) {
            blk = e / 4;
            ctr[0] = (uint32_t)blk, ctr[1] = (uint32_t)(blk >> 32), ctr[2] = 0, ctr[3] = 0;
            mn_philox4x32(ctr, seed, word);
        }
        keep[i] = (uint8_t)((double)word[e % 4] < thr);
    }
}

MNIMPL mn_result mn_dropout_mask(uint8_t *mask, size_t n, float p, uint64_t seed, uint64_t offset) {
    long c, nc = (long)((n + MN__DROP_CHUNK - 1) / MN__DROP_CHUNK);
    if (!mask || !mn__dropout_p_valid(p)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (c = 0; c < nc; c++) {
        size_t i0 = (size_t)c * MN__DROP_CHUNK;
        size_t m = n - i0 < MN__DROP_CHUNK ? n - i0 : MN__DROP_CHUNK;
        mn__dropout_keep(mask + i0, m, p, seed, offset + i0);
    }
    return MN_OK;
}

MNIMPL mn_result mn_dropout_forward(float *out, uint8_t *mask, const float *inp, size_t n,
                                    float p, uint64_t seed, uint64_t offset) {
    // y = x keep / (1 - p) (inverted dropout: the expectation of y is x, nothing to do at test time)
    long c, nc = (long)((n + MN__DROP_CHUNK - 1) / MN__DROP_CHUNK);
    float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    if (!out || !inp || !mn__dropout_p_valid(p)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (c = 0; c < nc; c++) {
        uint8_t keep[MN__DROP_CHUNK];
        size_t i0 = (size_t)c * MN__DROP_CHUNK, i;
        size_t m = n - i0 < MN__DROP_CHUNK ? n - i0 : MN__DROP_CHUNK;
        mn__dropout_keep(keep, m, p, seed, offset + i0);
        for (i = 0; i < m; i++) out[i0 + i] = keep[i] ? inp[i0 + i] * scale : 0.0f;
        if (mask) memcpy(mask + i0, keep, m);
    }
    return MN_OK;
}

MNIMPL mn_result mn_dropout_backward(float *dinp, const float *dout, const uint8_t *mask, size_t n,
                                     float p, uint64_t seed, uint64_t offset) {
    // dx += dy keep / (1 - p)
    long c, nc = (long)((n + MN__DROP_CHUNK - 1) / MN__DROP_CHUNK);
    float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
    if (!dinp || !dout || !mn__dropout_p_valid(p)) return MN_ERR_INVALID_ARG;
    MN__OMP_FOR_IF(n >= MN__OMP_MIN_ELEMS)
    for (c = 0; c < nc; c++) {
        uint8_t keep[MN__DROP_CHUNK];
        size_t i0 = (size_t)c * MN__DROP_CHUNK, i;
        size_t m = n - i0 < MN__DROP_CHUNK ? n - i0 : MN__DROP_CHUNK;
        const uint8_t *k = keep;
        if (mask) k = mask + i0;
        else mn__dropout_keep(keep, m, p, seed, offset + i0);
        for (i = 0; i < m; i++)
            if (k[i]) dinp[i0 + i] += dout[i0 + i] * scale;
    }
    return MN_OK;
}
