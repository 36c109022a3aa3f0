// The CUDA kernels' math (memanat.h >>cuda, the mn_hd_* functions) on the host, against the CPU
// reference ops: every build runs these, GPU or not. Each kernel of memanat_cuda.cu reads its
// inputs from fp32/fp16/bf16 storage, computes in fp32 with these functions and rounds its
// outputs to the storage type; the tests do the same (storage emulated with the header's
// round-to-nearest-even conversions) and compare with the reference op run on the same stored
// inputs. Tolerance |got - want| <= tol + tol |want| with tol per storage type:
//   fp32 1e-5 (5e-5 for the reductions over 50257 logits), fp16 1e-3 (2 x its unit roundoff
//   2^-11), bf16 8e-3 (2 x 2^-8).
// The row reductions are checked in the order the device uses them: 32 lane-strided partial
// states merged by the warp's xor tree (softmax, layernorm) or 512 thread states merged in order
// (the cross-entropy block).
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static const mn_dtype dtypes[3] = {MN_FP32, MN_FP16, MN_BF16};
static const double dtype_tol[3] = {1e-5, 1e-3, 8e-3};

// x as stored in dtype and read back.
static float st(mn_dtype dt, float x) {
    if (dt == MN_FP16) return mn_fp16_to_fp32(mn_fp32_to_fp16(x));
    if (dt == MN_BF16) return mn_bf16_to_fp32(mn_fp32_to_bf16(x));
    return x;
}

static void fill_stored(mn_dtype dt, float *x, size_t n, double scale) {
    size_t i;
    mnt_fill_normal(x, n, scale);
    for (i = 0; i < n; i++) x[i] = st(dt, x[i]);
}

static double *widen(const float *x, size_t n) {
    double *d = mnt_dvec(n);
    mnt_to_double(x, d, n);
    return d;
}

#define CHECK_DT(what, dt_i, got, want_f, n) do { double *w_ = widen(want_f, n); \
    CHECK_CLOSE(what, got, w_, n, dtype_tol[dt_i], dtype_tol[dt_i]); free(w_); } while (0)

static void test_gelu(void) {
    size_t n = 1001, i;
    int d;
    for (d = 0; d < 3; d++) {
        mn_dtype dt = dtypes[d];
        float *x = mnt_fvec(n), *dy = mnt_fvec(n), *dx0 = mnt_fvec(n);
        float *ref = mnt_fvec(n), *got = mnt_fvec(n), *rdx = mnt_fvec(n), *gdx = mnt_fvec(n);
        fill_stored(dt, x, n, 3.0);
        fill_stored(dt, dy, n, 1.0);
        fill_stored(dt, dx0, n, 1.0);
        mn_gelu_forward(ref, x, n);
        for (i = 0; i < n; i++) got[i] = st(dt, mn_hd_gelu(x[i]));
        CHECK_DT("gelu forward", d, got, ref, n);
        memcpy(rdx, dx0, n * sizeof *rdx);
        mn_gelu_backward(rdx, dy, x, n);
        for (i = 0; i < n; i++) gdx[i] = st(dt, dx0[i] + dy[i] * mn_hd_gelu_grad(x[i]));
        CHECK_DT("gelu backward", d, gdx, rdx, n);
        free(x), free(dy), free(dx0), free(ref), free(got), free(rdx), free(gdx);
    }
}

// The 16-bit kernels' GELU, x / (1 + exp(-2u)): against the same function in double within fp32's
// conditioning (4 ulp for x >= 0; 1e-37 absolute where it underflows) on fresh normal, wide
// uniform and edge values, and through fp16/bf16 storage against the reference op within the
// storage tolerance.
static void test_gelu_fast(void) {
    enum { N = 200000 };
    static const float edge[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-3f, -1e-3f, 3.0f, -3.0f, -5.5f,
                                 -9.9f, -10.0f, -12.0f, -20.0f, -88.0f, -6e4f, 6e4f, 40.0f};
    float *x = mnt_fvec(N), *ref = mnt_fvec(N), *got = mnt_fvec(N);
    double worst = 0.0;
    size_t i;
    int d;
    for (i = 0; i < N; i++)
        x[i] = i < sizeof edge / sizeof edge[0] ? edge[i]
               : i % 2 ? (float)(3.0 * mnt_rand_normal())
                       : (float)(60.0 * mnt_rand_uniform() - 30.0);
    for (i = 0; i < N; i++) {
        double xd = x[i], u = 0.7978845608028654 * (xd + 0.044715 * xd * xd * xd);
        // 0.5 x (1 + tanh u) in double would cancel to 0 below x = -9 (tanh rounds to -1)
        double want = xd / (1.0 + exp(-2.0 * u)), g = mn_hd_gelu_fast(x[i]);
        // fp32's own conditioning: u carries a few ulp of its largest term, and exp(-2u) turns
        // that into a relative error of about |2u| of them (1.5e-5 near x = -9.5, where the
        // result is 1e-35): 4 |u| + 4 units of 2^-23
        double lim = (4.0 * fabs(u) + 4.0) * ldexp(1.0, -23) * fabs(want) + 1e-37;
        double err = fabs(g - want);
        if (err > lim) {
            CHECK(err <= lim);
            break;
        }
        if (xd >= 0.0 && err / (fabs(want) + 1e-300) > worst) worst = err / (fabs(want) + 1e-300);
    }
    CHECK(worst < 4.8e-7);  // 4 ulp for x >= 0, where exp(-2u) <= 1
    CHECK(isnan(mn_hd_gelu_fast(-INFINITY)) && isnan(mn_hd_gelu(-INFINITY)));
    CHECK(mn_hd_gelu_fast(INFINITY) == INFINITY && isnan(mn_hd_gelu_fast(NAN)));
    CHECK(mn_hd_gelu_fast(-200.0f) == 0.0f && mn_hd_gelu(-200.0f) == 0.0f);
    for (d = 1; d < 3; d++) {  // the storage the fast form serves
        for (i = 0; i < N; i++) x[i] = st(dtypes[d], x[i]);
        mn_gelu_forward(ref, x, N);
        for (i = 0; i < N; i++) got[i] = st(dtypes[d], mn_hd_gelu_fast(x[i]));
        CHECK_DT("gelu forward, 16-bit kernels' form", d, got, ref, N);
    }
    free(x), free(ref), free(got);
}

// exp(a x - m) as the 16-bit kernels' row loops take it (one FMA, then exp2): relative error
// within (|a x| + |m| + 1) 2^-22 of exp in double on fresh rows (the row's maximum as m, as the
// kernels have it), and exactly 0 for a masked -inf.
static void test_exp_fma(void) {
    int r;
    for (r = 0; r < 2000; r++) {
        float a = (float)(0.05 + 2.0 * mnt_rand_uniform()), x[64], m = -INFINITY;
        float al, ml;
        int j;
        for (j = 0; j < 64; j++) {
            x[j] = (float)((r % 3 ? 4.0 : 40.0) * mnt_rand_normal());
            if (a * x[j] > m) m = a * x[j];
        }
        al = a * MN_HD_LOG2E, ml = m * MN_HD_LOG2E;
        for (j = 0; j < 64; j++) {
            double want = exp((double)a * x[j] - m), got = mn_hd_exp_fma(x[j], al, ml);
            double lim = (fabs((double)a * x[j]) + fabs(m) + 1.0) * ldexp(1.0, -22) * want + 1e-38;
            if (fabs(got - want) > lim) {
                CHECK(fabs(got - want) <= lim);
                return;
            }
        }
        CHECK(mn_hd_exp_fma(-INFINITY, al, ml) == 0.0f);
    }
}

// The warp's view of a row: lane l sums elements l, l+32, ...; the xor tree adds lane pairs.
static float warp_sum_rows(const float *v, size_t n) {
    float lane[32];
    size_t i;
    int l, o;
    for (l = 0; l < 32; l++) lane[l] = 0.0f;
    for (i = 0; i < n; i++) lane[i % 32] += v[i];
    for (o = 16; o > 0; o >>= 1) {
        float next[32];
        for (l = 0; l < 32; l++) next[l] = lane[l] + lane[l ^ o];
        memcpy(lane, next, sizeof lane);
    }
    return lane[0];
}

static void test_layernorm(void) {
    static const size_t shapes[][2] = {{1, 1}, {3, 37}, {5, 769}, {2, 1600}, {7, 8}};
    size_t s, n, i;
    int d;
    for (d = 0; d < 3; d++)
        for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            mn_dtype dt = dtypes[d];
            size_t N = shapes[s][0], C = shapes[s][1];
            float *x = mnt_fvec(N * C), *w = mnt_fvec(C), *b = mnt_fvec(C), *dy = mnt_fvec(N * C);
            float *ref = mnt_fvec(N * C), *got = mnt_fvec(N * C), *mu = mnt_fvec(N);
            float *rs = mnt_fvec(N), *gmu = mnt_fvec(N), *grs = mnt_fvec(N);
            float *rdx = mnt_fvec(N * C), *gdx = mnt_fvec(N * C), *tmp = mnt_fvec(C);
            float *tmp2 = mnt_fvec(C);
            fill_stored(dt, x, N * C, 2.0);
            for (i = 0; i < N * C; i++) x[i] = st(dt, x[i] + 0.5f);
            fill_stored(dt, w, C, 1.0);
            fill_stored(dt, b, C, 1.0);
            fill_stored(dt, dy, N * C, 1.0);
            mn_layernorm_forward(ref, mu, rs, x, w, b, N, C, 1e-5f);
            for (n = 0; n < N; n++) {
                // the kernel: mean and variance by warp sums, then the per-element output
                const float *xr = x + n * C;
                float m, v, r;
                for (i = 0; i < C; i++) tmp[i] = xr[i];
                m = warp_sum_rows(tmp, C) / (float)C;
                for (i = 0; i < C; i++) tmp[i] = (xr[i] - m) * (xr[i] - m);
                v = warp_sum_rows(tmp, C) / (float)C;
                r = mn_hd_rstd(v, 1e-5f);
                for (i = 0; i < C; i++)
                    got[n * C + i] = st(dt, mn_hd_layernorm_out(xr[i], m, r, w[i], b[i]));
                gmu[n] = m, grs[n] = r;
            }
            CHECK_DT("layernorm out", d, got, ref, N * C);
            CHECK_DT("layernorm mean", 0, gmu, mu, N);
            CHECK_DT("layernorm rstd", 0, grs, rs, N);
            // the serial row function (one thread's order) agrees too
            for (n = 0; n < N; n++)
                mn_hd_layernorm_row(got + n * C, gmu + n, grs + n, x + n * C, w, b, C, 1e-5f);
            for (i = 0; i < N * C; i++) got[i] = st(dt, got[i]);
            CHECK_DT("layernorm row", d, got, ref, N * C);
            // backward dinp from the forward's statistics
            mn_layernorm_backward(rdx, NULL, NULL, dy, x, w, mu, rs, N, C);
            for (n = 0; n < N; n++) {
                const float *xr = x + n * C, *dyr = dy + n * C;
                float gm, gxm;
                for (i = 0; i < C; i++) {
                    tmp[i] = w[i] * dyr[i];
                    tmp2[i] = tmp[i] * ((xr[i] - mu[n]) * rs[n]);
                }
                gm = warp_sum_rows(tmp, C) / (float)C;
                gxm = warp_sum_rows(tmp2, C) / (float)C;
                for (i = 0; i < C; i++)
                    gdx[n * C + i] = st(dt, mn_hd_layernorm_dinp(w[i] * dyr[i],
                                                                (xr[i] - mu[n]) * rs[n], gm, gxm,
                                                                rs[n]));
            }
            CHECK_DT("layernorm backward dinp", d, gdx, rdx, N * C);
            free(x), free(w), free(b), free(dy), free(ref), free(got), free(mu), free(rs);
            free(gmu), free(grs), free(rdx), free(gdx), free(tmp), free(tmp2);
        }
}

// The warp's online softmax: lane states over j = l, l+32, ... merged by the xor tree.
static mn_hd_maxsum warp_maxsum(const float *x, size_t len, float scale) {
    mn_hd_maxsum lane[32];
    size_t j;
    int l, o;
    for (l = 0; l < 32; l++) lane[l] = mn_hd_maxsum_init();
    for (j = 0; j < len; j++) lane[j % 32] = mn_hd_maxsum_add(lane[j % 32], scale * x[j]);
    for (o = 16; o > 0; o >>= 1) {
        mn_hd_maxsum next[32];
        for (l = 0; l < 32; l++) next[l] = mn_hd_maxsum_merge(lane[l], lane[l ^ o]);
        memcpy(lane, next, sizeof lane);
    }
    return lane[0];
}

static void test_softmax(void) {
    static const size_t shapes[][2] = {{4, 1}, {6, 5}, {3, 77}, {2, 1000}, {64, 64}};
    size_t s, n, j;
    int d, causal;
    for (d = 0; d < 3; d++)
        for (causal = 0; causal < 2; causal++)
            for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                mn_dtype dt = dtypes[d];
                size_t N = shapes[s][0], L = shapes[s][1];
                float scale = 1.0f / sqrtf((float)L), *x = mnt_fvec(N * L), *dy = mnt_fvec(N * L);
                float *ref = mnt_fvec(N * L), *got = mnt_fvec(N * L), *rdx = mnt_fvec(N * L);
                float *gdx = mnt_fvec(N * L), *tmp = mnt_fvec(L);
                fill_stored(dt, x, N * L, 3.0);
                fill_stored(dt, dy, N * L, 1.0);
                mn_softmax_forward(ref, x, N, L, scale, causal);
                for (n = 0; n < N; n++) {
                    size_t len = (size_t)mn_hd_softmax_len(n, L, causal);
                    mn_hd_maxsum m = warp_maxsum(x + n * L, len, scale);
                    for (j = 0; j < L; j++)
                        got[n * L + j] =
                            st(dt, j < len ? mn_hd_softmax_prob(scale * x[n * L + j], m) : 0.0f);
                }
                CHECK_DT("softmax forward", d, got, ref, N * L);
                for (n = 0; n < N; n++) {  // masked columns exactly 0
                    for (j = (size_t)mn_hd_softmax_len(n, L, causal); j < L; j++)
                        CHECK(got[n * L + j] == 0.0f);
                    mn_hd_softmax_row(got + n * L, x + n * L, n, L, scale, causal);
                }
                for (j = 0; j < N * L; j++) got[j] = st(dt, got[j]);
                CHECK_DT("softmax row", d, got, ref, N * L);
                // backward from the stored forward output
                for (j = 0; j < N * L; j++) got[j] = st(dt, ref[j]);
                mn_softmax_backward(rdx, dy, got, N, L, scale, causal);
                for (n = 0; n < N; n++) {
                    size_t len = (size_t)mn_hd_softmax_len(n, L, causal);
                    float dot;
                    for (j = 0; j < L; j++) tmp[j] = j < len ? got[n * L + j] * dy[n * L + j] : 0.0f;
                    dot = warp_sum_rows(tmp, len);
                    for (j = 0; j < L; j++)
                        gdx[n * L + j] = j < len ? st(dt, mn_hd_softmax_dinp(got[n * L + j],
                                                                             dy[n * L + j], dot,
                                                                             scale))
                                                 : 0.0f;
                }
                CHECK_DT("softmax backward", d, gdx, rdx, N * L);
                free(x), free(dy), free(ref), free(got), free(rdx), free(gdx), free(tmp);
            }
}

// The causal softmax's row pairs as the pair kernels of memanat_cuda.cu walk them, lane by lane:
// every row in one work item, rows t and L - 1 - t of a whole matrix together; the two rows'
// packs within the NP + 1 slots a lane has (NP: the register path's packs for L); every visible
// column read once, every column of both rows written once (a slot's pack or a zero pack).
static void test_softmax_pairs(void) {
    static const size_t Ks[2] = {4, 8};
    int trial;
    for (trial = 0; trial < 300; trial++) {
        size_t K = Ks[trial % 2], P = 32 * K, NP = 1, L, N, w, r, items, lane, s, j, c;
        unsigned char *seen, *rd, *wr;
        L = K * (1 + (size_t)(mnt_rand_u64() % 256));  // up to 32 K 8 columns, as the path
        while (L > P * NP) NP *= 2;
        N = trial < 8 ? (size_t)trial + 1 : 1 + (size_t)(mnt_rand_u64() % (3 * L + 5));
        items = (size_t)mn_hd_softmax_pairs(N, L);
        seen = (unsigned char *)calloc(N, 1);
        rd = (unsigned char *)calloc(N * L, 1), wr = (unsigned char *)calloc(N * L, 1);
        if (!seen || !rd || !wr) {
            CHECK_MSG(0, "out of host memory");
            free(seen), free(rd), free(wr);
            return;
        }
        for (w = 0; w < items; w++) {
            uint64_t ra, rb;
            size_t la, lb, ja, jb;
            mn_hd_softmax_pair(w, N, L, &ra, &rb);
            if (!(ra < N && rb < N && ra <= rb)) {
                CHECK_MSG(0, "item %zu of N %zu L %zu: rows %llu, %llu", w, N, L,
                          (unsigned long long)ra, (unsigned long long)rb);
                break;
            }
            if (rb != ra) CHECK(ra / L == rb / L && ra % L + rb % L == L - 1 && rb / L < N / L);
            seen[ra]++;
            if (rb != ra) seen[rb]++;
            la = (size_t)mn_hd_softmax_len(ra, L, 1);
            lb = rb != ra ? (size_t)mn_hd_softmax_len(rb, L, 1) : 0;
            ja = (la + P - 1) / P, jb = (lb + P - 1) / P;
            CHECK(ja + jb <= NP + 1);
            for (lane = 0; lane < 32; lane++) {
                for (s = 0; s <= NP; s++) {  // the slots: reads, then the pack's store
                    int inb = s >= ja;
                    size_t jj = inb ? s - ja : s, i = (jj * 32 + lane) * K, row = inb ? rb : ra;
                    size_t len = inb ? lb : la;
                    for (c = i; c < i + K && c < len; c++) rd[row * L + c]++;
                    if ((inb && jj >= jb) || i >= L) continue;
                    for (c = i; c < i + K; c++) wr[row * L + c]++;
                }
                for (j = 0; j < NP; j++) {  // the zero packs
                    size_t i = (j * 32 + lane) * K;
                    if (i >= L) continue;
                    if (j >= ja)
                        for (c = i; c < i + K; c++) wr[ra * L + c]++;
                    if (lb && j >= jb)
                        for (c = i; c < i + K; c++) wr[rb * L + c]++;
                }
            }
        }
        for (r = 0; r < N; r++) {
            CHECK(seen[r] == 1);
            for (c = 0; c < L; c++) {
                CHECK(rd[r * L + c] == (c < (size_t)mn_hd_softmax_len(r, L, 1)));
                CHECK(wr[r * L + c] == 1);
            }
        }
        free(seen), free(rd), free(wr);
    }
}

static void test_crossentropy(void) {
    static const size_t shapes[][2] = {{3, 50257}, {5, 37}, {1, 1}};
    size_t s, n, j;
    int d;
    for (d = 0; d < 3; d++)
        for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            mn_dtype dt = dtypes[d];
            size_t N = shapes[s][0], V = shapes[s][1];
            float dloss = 1.0f / (float)N, *x = mnt_fvec(N * V), *rl = mnt_fvec(N);
            float *gl = mnt_fvec(N), *rdx = mnt_fvec(N * V), *gdx = mnt_fvec(N * V);
            float *dl = mnt_fvec(N), *gl2 = mnt_fvec(N), *gdx2 = mnt_fvec(N * V);
            int *tg = (int *)calloc(N, sizeof(int));
            double tol = d == 0 ? 5e-5 : dtype_tol[d];
            if (!tg) abort();
            fill_stored(dt, x, N * V, 4.0);
            for (n = 0; n < N; n++) tg[n] = (int)(mnt_rand_u64() % V), dl[n] = dloss;
            if (N > 1) tg[1] = -1;  // an ignored row
            CHECK_OK(mn_crossentropy_forward(rl, NULL, x, tg, N, V));
            CHECK_OK(mn_crossentropy_backward(rdx, dl, NULL, x, tg, N, V));
            for (n = 0; n < N; n++) {
                // the block: 512 thread states over j = t, t+512, ..., merged in order
                mn_hd_maxsum th[512], m = mn_hd_maxsum_init();
                int t;
                for (t = 0; t < 512; t++) th[t] = mn_hd_maxsum_init();
                for (j = 0; j < V; j++) th[j % 512] = mn_hd_maxsum_add(th[j % 512], x[n * V + j]);
                for (t = 0; t < 512; t++) m = mn_hd_maxsum_merge(m, th[t]);
                gl[n] = tg[n] < 0 ? 0.0f : mn_hd_ce_loss(m, x[n * V + (size_t)tg[n]]);
                for (j = 0; j < V; j++)
                    gdx[n * V + j] = tg[n] < 0 ? 0.0f : st(dt, mn_hd_ce_dlogit(x[n * V + j], m,
                                                                           (int)j == tg[n], dloss));
                mn_hd_crossentropy_row(gl2 + n, gdx2 + n * V, x + n * V, tg[n], V, dloss);
            }
            {
                double *w = widen(rl, N), *wd = widen(rdx, N * V);
                CHECK_CLOSE("crossentropy loss", gl, w, N, tol, tol);
                CHECK_CLOSE("crossentropy loss (row)", gl2, w, N, tol, tol);
                CHECK_CLOSE("crossentropy dlogits", gdx, wd, N * V, tol * dloss, tol);
                for (j = 0; j < N * V; j++) gdx2[j] = st(dt, gdx2[j]);
                CHECK_CLOSE("crossentropy dlogits (row)", gdx2, wd, N * V, tol * dloss, tol);
                free(w), free(wd);
            }
            free(x), free(rl), free(gl), free(rdx), free(gdx), free(dl), free(gl2), free(gdx2);
            free(tg);
        }
}

// Attention as the device runs it: q, k, v gathered into per-head buffers [B*NH,T,hsp] through
// mn_hd_head_index (the padding columns hold NaN, so a product that read them would show it),
// every GEMM a plain fp32 sum whose result is stored in the dtype (cuBLASLt accumulates in fp32;
// only its summation order differs), the softmax and its backward per row with the mn_hd_*
// functions, stored in the dtype between the steps as the scratch buffers are. Compared with
// mn_attention_forward / mn_attention_backward on the same stored inputs. Tolerance |got - want|
// <= tol (1 + |want|): fp32 1e-5; 16-bit storage of the scores, probabilities, dp and ds adds
// its rounding to every intermediate: fp16 4e-3, bf16 3e-2 (the largest error seen over these
// shapes and many seeds is about half of that).
static void att_gather(mn_dtype dt, float *heads[3], const float *flat, size_t n, size_t T,
                       size_t C, size_t NH, size_t hsp, unsigned parts) {
    size_t i;
    for (i = 0; i < n; i++) {
        uint64_t part, j = mn_hd_head_index(i, T, C, NH, hsp, parts, &part);
        heads[part][j] = st(dt, flat[i]);
    }
}

// D[bh][r][c] = sum_e X[bh][r][e] Y[bh][c][e] (xt: X is [e][r]; yt: Y is [e][c]), stored in dt.
static void att_gemm(mn_dtype dt, float *D, size_t ldd, const float *X, size_t ldx, int xt,
                     const float *Y, size_t ldy, int yt, size_t BH, size_t R, size_t Cn, size_t E,
                     size_t sx, size_t sy, size_t sd) {
    size_t bh, r, c, e;
    for (bh = 0; bh < BH; bh++)
        for (r = 0; r < R; r++)
            for (c = 0; c < Cn; c++) {
                float s = 0.0f;
                for (e = 0; e < E; e++)
                    s += X[bh * sx + (xt ? e * ldx + r : r * ldx + e)] *
                         Y[bh * sy + (yt ? e * ldy + c : c * ldy + e)];
                D[bh * sd + r * ldd + c] = st(dt, s);
            }
}

static void test_attention(void) {
    static const size_t shapes[][4] = {{1, 1, 8, 2}, {2, 7, 60, 4}, {1, 33, 48, 3}, {2, 20, 64, 2}};
    static const double att_tol[3] = {1e-5, 4e-3, 3e-2};
    size_t s, i, n, j;
    int d, causal;
    for (d = 0; d < 3; d++)
        for (causal = 0; causal < 2; causal++)
            for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                mn_dtype dt = dtypes[d];
                size_t B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], NH = shapes[s][3];
                size_t hs = C / NH, hsp = (size_t)mn_hd_head_ld(hs), BH = B * NH;
                size_t nh = BH * T * hsp, ntt = BH * T * T, th = T * hsp, tt = T * T;
                float scale = 1.0f / sqrtf((float)hs), *qkv = mnt_fvec(B * T * 3 * C);
                float *dout = mnt_fvec(B * T * C), *dqkv0 = mnt_fvec(B * T * 3 * C);
                float *out = mnt_fvec(B * T * C), *att = mnt_fvec(ntt), *rdq = mnt_fvec(B * T * 3 * C);
                float *rdq2 = mnt_fvec(B * T * 3 * C), *gout = mnt_fvec(B * T * C);
                float *gdq = mnt_fvec(B * T * 3 * C), *buf = mnt_fvec(10 * nh + 3 * ntt);
                float *q = buf, *k = q + nh, *v = k + nh, *dy = v + nh, *y = dy + nh, *dq = y + nh;
                float *dk = dq + nh, *dv = dk + nh, *S = buf + 10 * nh, *dP = S + ntt, *dS = dP + ntt;
                float *qkvh[3], *yh[3], *dyh[3];
                double tol = att_tol[d];
                char what[96];
                for (i = 0; i < 10 * nh; i++) buf[i] = (float)NAN;  // padding must stay unread
                fill_stored(dt, qkv, B * T * 3 * C, 1.0);
                fill_stored(dt, dout, B * T * C, 1.0);
                fill_stored(dt, dqkv0, B * T * 3 * C, 1.0);
                // the reference: forward keeping att, backward with att and with NULL (same bits)
                mn_attention_forward(out, att, qkv, B, T, C, NH, causal);
                memcpy(rdq, dqkv0, B * T * 3 * C * sizeof *rdq);
                memcpy(rdq2, dqkv0, B * T * 3 * C * sizeof *rdq);
                mn_attention_backward(rdq, dout, qkv, att, B, T, C, NH, causal);
                mn_attention_backward(rdq2, dout, qkv, NULL, B, T, C, NH, causal);
                CHECK(memcmp(rdq, rdq2, B * T * 3 * C * sizeof *rdq) == 0);
                // the device's sequence
                qkvh[0] = q, qkvh[1] = k, qkvh[2] = v, yh[0] = yh[1] = yh[2] = y;
                dyh[0] = dyh[1] = dyh[2] = dy;
                att_gather(dt, qkvh, qkv, B * T * 3 * C, T, C, NH, hsp, 3);
                att_gemm(dt, S, T, q, hsp, 0, k, hsp, 0, BH, T, T, hs, th, th, tt);  // q k^T
                for (n = 0; n < BH * T; n++) {
                    mn_hd_softmax_row(S + n * T, S + n * T, n, T, scale, causal);
                    for (j = 0; j < T; j++) S[n * T + j] = st(dt, S[n * T + j]);
                }
                att_gemm(dt, y, hsp, S, T, 0, v, hsp, 1, BH, T, hs, T, tt, th, th);  // P v
                for (i = 0; i < B * T * C; i++) {
                    uint64_t part, hj = mn_hd_head_index(i, T, C, NH, hsp, 1, &part);
                    gout[i] = yh[part][hj];
                }
                snprintf(what, sizeof what, "attention out %zux%zux%zux%zu%s", B, T, C, NH,
                         causal ? " causal" : "");
                {
                    double *w = widen(out, B * T * C), *wa = widen(att, ntt);
                    CHECK_CLOSE(what, gout, w, B * T * C, tol, tol);
                    CHECK_CLOSE("attention att", S, wa, ntt, tol, tol);
                    free(w), free(wa);
                }
                // backward
                att_gather(dt, dyh, dout, B * T * C, T, C, NH, hsp, 1);
                att_gemm(dt, dP, T, dy, hsp, 0, v, hsp, 0, BH, T, T, hs, th, th, tt);  // dy v^T
                for (n = 0; n < BH * T; n++) {
                    size_t len = (size_t)mn_hd_softmax_len(n, T, causal);
                    float dot = 0.0f;
                    for (j = 0; j < len; j++) dot += S[n * T + j] * dP[n * T + j];
                    for (j = 0; j < T; j++)
                        dS[n * T + j] = j < len ? st(dt, mn_hd_softmax_dinp(S[n * T + j],
                                                                            dP[n * T + j], dot,
                                                                            scale))
                                                : 0.0f;
                }
                att_gemm(dt, dq, hsp, dS, T, 0, k, hsp, 1, BH, T, hs, T, tt, th, th);  // dS k
                att_gemm(dt, dk, hsp, dS, T, 1, q, hsp, 1, BH, T, hs, T, tt, th, th);  // dS^T q
                att_gemm(dt, dv, hsp, S, T, 1, dy, hsp, 1, BH, T, hs, T, tt, th, th);  // P^T dy
                for (i = 0; i < B * T * 3 * C; i++) {
                    uint64_t part, hj = mn_hd_head_index(i, T, C, NH, hsp, 3, &part);
                    const float *src = part == 0 ? dq : part == 1 ? dk : dv;
                    gdq[i] = st(dt, dqkv0[i] + src[hj]);
                }
                snprintf(what, sizeof what, "attention dqkv %zux%zux%zux%zu%s", B, T, C, NH,
                         causal ? " causal" : "");
                {
                    double *w = widen(rdq, B * T * 3 * C);
                    CHECK_CLOSE(what, gdq, w, B * T * 3 * C, tol, tol);
                    free(w);
                }
                free(qkv), free(dout), free(dqkv0), free(out), free(att), free(rdq), free(rdq2);
                free(gout), free(gdq), free(buf);
            }
}

// D = op(A) . op(B) for each of BH heads in cuBLAS's column-major convention, exactly as the
// descriptor g says (offsets, leading dimensions, transposes), sums in fp32; heads sa, sb, sd
// elements apart.
static void att_cm_gemm(const mn_hd_att_gemm *g, float *D, const float *A, const float *Bm,
                        size_t BH, size_t sa, size_t sb, size_t sd) {
    size_t h, i, j, e;
    for (h = 0; h < BH; h++)
        for (j = 0; j < g->n; j++)
            for (i = 0; i < g->m; i++) {
                const float *a = A + h * sa + g->a, *b = Bm + h * sb + g->b;
                float sum = 0.0f;
                for (e = 0; e < g->k; e++)
                    sum += (g->ta ? a[i * g->lda + e] : a[e * g->lda + i]) *
                           (g->tb ? b[e * g->ldb + j] : b[j * g->ldb + e]);
                D[h * sd + g->d + j * g->ldd + i] = sum;
            }
}

// The device's attention GEMMs as mn_hd_att_gemm_block describes them, block by block (causal
// from T = 256 on: 4 query blocks, the masked half not computed), run on the host in fp32 and
// compared with mn_attention_forward / mn_attention_backward: the output and dqkv within 1e-5.
// Every score the blocks leave uncomputed holds NaN, as does the head buffers' padding, so a
// read of either would show; the blocks tile the rows exactly.
static void test_attention_blocks(void) {
    static const size_t shapes[][4] = {{1, 300, 48, 2}, {2, 256, 32, 2}, {1, 37, 16, 1},
                                       {1, 263, 24, 3}};
    size_t s, i, n, j, c;
    int causal;
    for (causal = 0; causal < 2; causal++)
        for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            size_t B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], NH = shapes[s][3];
            size_t hs = C / NH, hsp = (size_t)mn_hd_head_ld(hs), BH = B * NH;
            size_t nh = BH * T * hsp, ntt = BH * T * T, th = T * hsp, tt = T * T;
            uint64_t nb = mn_hd_att_blocks(T, causal), r0, r1, rows = 0;
            float scale = 1.0f / sqrtf((float)hs), *qkv = mnt_fvec(B * T * 3 * C);
            float *dout = mnt_fvec(B * T * C), *out = mnt_fvec(B * T * C), *att = mnt_fvec(ntt);
            float *rdq = mnt_fvec(B * T * 3 * C), *gout = mnt_fvec(B * T * C);
            float *gdq = mnt_fvec(B * T * 3 * C), *buf = mnt_fvec(8 * nh + 3 * ntt);
            float *q = buf, *k = q + nh, *v = k + nh, *dy = v + nh, *y = dy + nh, *dq = y + nh;
            float *dk = dq + nh, *dv = dk + nh, *S = buf + 8 * nh, *dP = S + ntt, *dS = dP + ntt;
            float *qkvh[3], *dyh[3];
            mn_hd_att_gemm g;
            CHECK(nb == (causal && T >= 256 ? 4u : 1u));
            for (i = 0; i < 8 * nh + 2 * ntt; i++) buf[i] = (float)NAN;
            for (i = 0; i < ntt; i++) dS[i] = 0.0f;  // the device zeroes dS before its kernel
            mnt_fill_normal(qkv, B * T * 3 * C, 1.0);
            mnt_fill_normal(dout, B * T * C, 1.0);
            mn_attention_forward(out, att, qkv, B, T, C, NH, causal);
            mn_attention_backward(rdq, dout, qkv, att, B, T, C, NH, causal);
            qkvh[0] = q, qkvh[1] = k, qkvh[2] = v, dyh[0] = dyh[1] = dyh[2] = dy;
            att_gather(MN_FP32, qkvh, qkv, B * T * 3 * C, T, C, NH, hsp, 3);
            att_gather(MN_FP32, dyh, dout, B * T * C, T, C, NH, hsp, 1);
            for (c = 0; c < nb; c++) {  // S = q k^T
                mn_hd_att_block_rows(T, nb, c, &r0, &r1);
                rows += r1 - r0;
                g = mn_hd_att_gemm_block(MN_HD_ATT_QKT, T, hs, hsp, r0, r1);
                att_cm_gemm(&g, S, k, q, BH, th, th, tt);
            }
            CHECK_EQ_U64(rows, T);
            for (n = 0; n < BH * T; n++)
                mn_hd_softmax_row(S + n * T, S + n * T, n, T, scale, causal);
            for (c = 0; c < nb; c++) {  // y = P v, dP = dy v^T
                mn_hd_att_block_rows(T, nb, c, &r0, &r1);
                g = mn_hd_att_gemm_block(MN_HD_ATT_PV, T, hs, hsp, r0, r1);
                att_cm_gemm(&g, y, v, S, BH, th, tt, th);
                g = mn_hd_att_gemm_block(MN_HD_ATT_QKT, T, hs, hsp, r0, r1);
                att_cm_gemm(&g, dP, v, dy, BH, th, th, tt);
            }
            for (i = 0; i < B * T * C; i++) {
                uint64_t part, hj = mn_hd_head_index(i, T, C, NH, hsp, 1, &part);
                gout[i] = y[hj];
            }
            for (n = 0; n < BH * T; n++) {  // dS = softmax backward over the visible columns
                size_t len = (size_t)mn_hd_softmax_len(n, T, causal);
                float dot = 0.0f;
                for (j = 0; j < len; j++) dot += S[n * T + j] * dP[n * T + j];
                for (j = 0; j < len; j++)
                    dS[n * T + j] = mn_hd_softmax_dinp(S[n * T + j], dP[n * T + j], dot, scale);
            }
            for (c = 0; c < nb; c++) {  // dq = dS k; dk = dS^T q, dv = P^T dy (blocks of keys)
                mn_hd_att_block_rows(T, nb, c, &r0, &r1);
                g = mn_hd_att_gemm_block(MN_HD_ATT_PV, T, hs, hsp, r0, r1);
                att_cm_gemm(&g, dq, k, dS, BH, th, tt, th);
                g = mn_hd_att_gemm_block(MN_HD_ATT_PTV, T, hs, hsp, r0, r1);
                att_cm_gemm(&g, dk, q, dS, BH, th, tt, th);
                att_cm_gemm(&g, dv, dy, S, BH, th, tt, th);
            }
            for (i = 0; i < B * T * 3 * C; i++) {
                uint64_t part, hj = mn_hd_head_index(i, T, C, NH, hsp, 3, &part);
                gdq[i] = (part == 0 ? dq : part == 1 ? dk : dv)[hj];
            }
            {
                double *w = widen(out, B * T * C), *wd = widen(rdq, B * T * 3 * C);
                CHECK_CLOSE("attention blocks out", gout, w, B * T * C, 1e-5, 1e-5);
                CHECK_CLOSE("attention blocks dqkv", gdq, wd, B * T * 3 * C, 1e-5, 1e-5);
                free(w), free(wd);
            }
            free(qkv), free(dout), free(out), free(att), free(rdq), free(gout), free(gdq);
            free(buf);
        }
}

// The head layout: every element of qkv lands in its own place of q, k or v, and out's layout
// is the same map with one part.
static void test_head_index(void) {
    size_t B = 2, T = 5, C = 12, NH = 3, hs = 4, hsp = (size_t)mn_hd_head_ld(hs), i;
    size_t b, t, sp, h, dd;
    CHECK(mn_hd_head_ld(1) == 8 && mn_hd_head_ld(8) == 8 && mn_hd_head_ld(15) == 16);
    CHECK(mn_hd_head_ld(64) == 64);
    for (i = 0; i < B * T * 3 * C; i++) {
        uint64_t part, j = mn_hd_head_index(i, T, C, NH, hsp, 3, &part);
        b = i / (T * 3 * C), t = i / (3 * C) % T, sp = i % (3 * C) / C, h = i % C / hs;
        dd = i % hs;
        CHECK(part == sp);
        CHECK(j == ((b * NH + h) * T + t) * hsp + dd);
    }
    for (i = 0; i < B * T * C; i++) {
        uint64_t part, j = mn_hd_head_index(i, T, C, NH, hsp, 1, &part);
        b = i / (T * C), t = i / C % T, h = i % C / hs, dd = i % hs;
        CHECK(part == 0);
        CHECK(j == ((b * NH + h) * T + t) * hsp + dd);
    }
}

// mn_attention_scratch against the count in 128-bit integers (MN_ERR_OVERFLOW past 64 bits) on
// random shapes, small ones and ones that overflow, and one whose unused T x T buffer would
// overflow; GPT-2 small's backward at B 8, T 1024 in bf16 with the probabilities kept: 7 x 12 MiB
// + 2 x 192 MiB.
static void test_attention_scratch(void) {
    __extension__ typedef unsigned __int128 u128;
    uint64_t got = 1;
    int draw;
    CHECK_OK(mn_attention_scratch(8, 1024, 768, 12, 2, 1, 1, &got));
    CHECK(got == 468ull << 20);
    CHECK_OK(mn_attention_scratch(0, 1024, 768, 12, 2, 1, 1, &got));
    CHECK(got == 0);
    CHECK(mn_attention_scratch(8, 1024, 768, 12, 2, 1, 1, NULL) == MN_ERR_INVALID_ARG);
    for (draw = 0; draw < 20000; draw++) {
        int big = draw % 2, backward = (int)(mnt_rand_u64() % 2), kept = (int)(mnt_rand_u64() % 2);
        uint64_t B = 1 + mnt_rand_u64() % (big ? 1ull << 40 : 64);
        uint64_t T = 1 + mnt_rand_u64() % (big ? 1ull << 32 : 4096);
        uint64_t NH = 1 + mnt_rand_u64() % 64, hs = 1 + mnt_rand_u64() % 256, C = NH * hs;
        uint64_t esz = mnt_rand_u64() % 2 ? 2 : 4;
        mn_result r;
        if (draw == 0)  // no T x T buffer, whose count alone would pass 64 bits: 4 hb fits
            B = 122332530, T = 5383432, NH = 39, C = 1365, hs = 35, esz = 4, backward = 0, kept = 1;
        r = mn_attention_scratch(B, T, C, NH, esz, backward, kept, &got);
        u128 hsp = (hs + 7) / 8 * 8, rows = (u128)B * NH * T, hb, sb, want;
        hb = (rows * hsp * esz + 255) / 256 * 256, sb = (rows * T * esz + 255) / 256 * 256;
        want = backward ? 7 * hb + (kept ? 2 : 3) * sb : 4 * hb + (kept ? 0 : 1) * sb;
        CHECK_MSG(want > (u128)UINT64_MAX ? r == MN_ERR_OVERFLOW : r == MN_OK && got == want,
                  "B %llu T %llu C %llu NH %llu esz %llu %s %s: result %d, %llu",
                  (unsigned long long)B, (unsigned long long)T, (unsigned long long)C,
                  (unsigned long long)NH, (unsigned long long)esz, backward ? "bwd" : "fwd",
                  kept ? "kept" : "not kept", (int)r, (unsigned long long)got);
        if (mnt_failed()) break;
    }
}

// mn_hd_adamw against mn_adamw_step over several steps: the same fp32 operations in the same
// order, so the results agree to fp32 rounding (a contracted multiply-add may move one ulp).
static void test_adamw(void) {
    uint64_t n = 1003, dims[1];
    mn_adamw s;
    mn_adamw_params p;
    float *param = mnt_fvec(n), *grad = mnt_fvec(n), *hp = mnt_fvec(n), *hm = mnt_fvec(n);
    float *hv = mnt_fvec(n);
    uint16_t *p16 = (uint16_t *)calloc(n, sizeof(uint16_t));
    uint64_t i, t;
    int maximize;
    if (!p16) abort();
    dims[0] = n;
    for (maximize = 0; maximize < 2; maximize++) {
        memset(&p, 0, sizeof p);
        p.lr = 1e-2f, p.weight_decay = 0.1f, p.maximize = maximize, p.dtype = MN_BF16;
        CHECK_OK(mn_adamw_init(&s, dims, 1, &p, NULL));
        mnt_fill_normal(param, n, 1.0);
        memcpy(hp, param, n * sizeof *hp);
        memset(hm, 0, n * sizeof *hm), memset(hv, 0, n * sizeof *hv);
        for (t = 1; t <= 5; t++) {
            mn_hd_adamw_coef k = mn_hd_adamw_coefs(s.params.lr, s.params.beta1, s.params.beta2,
                                                   s.params.eps, s.params.weight_decay,
                                                   s.params.maximize, t);
            mnt_fill_normal(grad, n, 1.0);
            CHECK_OK(mn_adamw_step(&s, param, grad, p16));
            for (i = 0; i < n; i++) mn_hd_adamw(hp + i, hm + i, hv + i, grad[i], 1.0f, &k);
        }
        {
            double *w = widen(param, n), *wm = widen(s.exp_avg, n), *wv = widen(s.exp_avg_sq, n);
            CHECK_CLOSE("adamw param", hp, w, n, 1e-7, 1e-6);
            CHECK_CLOSE("adamw exp_avg", hm, wm, n, 1e-9, 1e-6);
            CHECK_CLOSE("adamw exp_avg_sq", hv, wv, n, 1e-12, 1e-6);
            free(w), free(wm), free(wv);
        }
        for (i = 0; i < n; i++) CHECK(p16[i] == mn_fp32_to_bf16(param[i]));
        mn_adamw_free(&s);
    }
    free(param), free(grad), free(hp), free(hm), free(hv), free(p16);
}

// 8-bit AdamW's per-block math (mn_hd_adamw8bit_block, the device kernel's order of operations) and
// its per-element fp32 path against mn_adamw8bit_step, 5 steps with fresh gradients, one of them
// inf (left unchanged, moments 0) and one NaN, and a few tiny negative gradients (moments that
// round to the map's 0 and must be coded below it): a quantized tensor whose last block is short (n
// = 5000, blocks of 256) and one of 1024-element blocks, parameters, codes and block scales bit for
// bit (the same arithmetic in the same order on the host); a small tensor (n = 1003) keeps fp32
// moments.
static void test_adamw8bit(void) {
    static const uint64_t sizes[] = {5000, 9000, 1003};
    static const uint32_t blocks[] = {256, 1024, 256};
    float map1[256], map2[256];
    size_t c;
    mn_dynamic_map(1, map1), mn_dynamic_map(0, map2);
    for (c = 0; c < 3; c++) {
        uint64_t n = sizes[c], dims[1], i, t, b;
        mn_adamw8bit s;
        mn_adamw8bit_params p;
        float *param = mnt_fvec(n), *grad = mnt_fvec(n), *hp = mnt_fvec(n), *hm = mnt_fvec(n);
        float *hv = mnt_fvec(n), *mbuf = mnt_fvec(4096), *vbuf = mnt_fvec(4096);
        float *a1 = mnt_fvec(n / 256 + 1), *a2 = mnt_fvec(n / 256 + 1);
        uint8_t *c1 = (uint8_t *)calloc(n, 1), *c2 = (uint8_t *)calloc(n, 1);
        uint64_t bad_p = 0, bad_c = 0, bad_a = 0;
        if (!c1 || !c2) abort();
        memset(&p, 0, sizeof p);
        p.lr = 1e-2f, p.weight_decay = 0.1f, p.block_size = blocks[c];
        dims[0] = n;
        CHECK_OK(mn_adamw8bit_init(&s, dims, 1, &p, NULL));
        memset(s.quantized ? (void *)s.absmax1 : (void *)s.exp_avg, 0, (size_t)s.state_bytes);
        CHECK_EQ_INT(s.quantized, n >= 4096);
        mnt_fill_normal(param, n, 1.0);
        memcpy(hp, param, n * sizeof *hp);
        for (t = 1; t <= 5; t++) {
            mn_hd_adamw8bit_coef k = mn_hd_adamw8bit_coefs(s.params.lr, s.params.beta1,
                                                           s.params.beta2, s.params.eps,
                                                           s.params.weight_decay, t);
            mnt_fill_normal(grad, n, 1.0);
            if (t == 2) grad[mnt_rand_u64() % n] = (float)HUGE_VAL;
            if (t == 4) grad[mnt_rand_u64() % n] = (float)NAN;
            for (i = 0; i < 8; i++)  // tiny negative moments: coded below 0, never at 0
                grad[mnt_rand_u64() % n] = -1e-12f * (float)(1 + i);
            CHECK_OK(mn_adamw8bit_step(&s, param, grad, NULL));
            if (!s.quantized) {
                for (i = 0; i < n; i++) {
                    float m, v;
                    if (mn_hd_adamw8bit_moments(&m, &v, grad[i], hm[i], hv[i], &k))
                        hm[i] = m, hv[i] = v, mn_hd_adamw8bit_param(&hp[i], m, v, &k);
                }
                continue;
            }
            for (b = 0, i = 0; i < n; b++, i += blocks[c])
                mn_hd_adamw8bit_block(hp + i, c1 + i, c2 + i, a1 + b, a2 + b, grad + i,
                                      n - i < blocks[c] ? n - i : blocks[c], 1.0f, map1, map2,
                                      &k, mbuf, vbuf);
        }
        for (i = 0; i < n; i++) bad_p += memcmp(&hp[i], &param[i], sizeof(float)) != 0;
        if (s.quantized) {
            for (i = 0; i < n; i++) bad_c += c1[i] != s.code1[i] || c2[i] != s.code2[i];
            for (b = 0; b < s.blocks; b++)
                bad_a += a1[b] != s.absmax1[b] || a2[b] != s.absmax2[b];
            CHECK(s.blocks == (n + blocks[c] - 1) / blocks[c]);
        } else {
            for (i = 0; i < n; i++) bad_c += hm[i] != s.exp_avg[i] || hv[i] != s.exp_avg_sq[i];
        }
        CHECK_MSG(bad_p == 0 && bad_c == 0 && bad_a == 0, "n %llu: %llu parameters, %llu codes "
                  "or moments, %llu scales differ", (unsigned long long)n,
                  (unsigned long long)bad_p, (unsigned long long)bad_c, (unsigned long long)bad_a);
        mn_adamw8bit_free(&s);
        free(param), free(grad), free(hp), free(hm), free(hv), free(mbuf), free(vbuf);
        free(a1), free(a2), free(c1), free(c2);
    }
}

// The quantization helpers against a linear scan of the map: the nearest entry (ties to the
// larger), and a negative value never coded at 0 or above (tiny negatives included).
static void test_q8_codes(void) {
    float map1[256], map2[256];
    int k;
    mn_dynamic_map(1, map1), mn_dynamic_map(0, map2);
    for (k = 0; k < 20000; k++) {
        const float *map = k % 2 ? map1 : map2;
        float x = (float)(k % 2 ? 2.0 * mnt_rand_uniform() - 1.0 : mnt_rand_uniform());
        uint32_t got = mn_hd_q8_nearest(map, x), want = 0, j;
        if (k % 7 == 0) x = map[mnt_rand_u64() % 256];  // exact entries
        if (k % 10 == 1) x = (float)(-1e-8 * mnt_rand_uniform());  // nearest to 0, negative
        got = mn_hd_q8_nearest(map, x);
        for (j = 1; j < 256; j++)
            if (fabsf(map[j] - x) <= fabsf(map[want] - x)) want = j;
        CHECK_MSG(got == want, "nearest to %.9g: got %u (%.9g) want %u (%.9g)", (double)x, got,
                  (double)map[got], want, (double)map[want]);
        if (k % 2) {
            uint32_t c = mn_hd_q8_code_signed(map1, x, 1.0f);
            CHECK(!(x < 0.0f) || map1[c] < 0.0f);
        }
    }
}

// The table lookup (mn_q8_table, mn_hd_q8_nearest_tab) against the search, for both dynamic maps:
// every entry, the floats next to each entry and to each midpoint, zeros, infinities, NaN,
// subnormals, uniform values in [-1.5, 1.5] and random bit patterns; for the unsigned map also
// the lookup in the table's upper half (mn_hd_q8_nearest_tab_pos) of each value's magnitude. A
// map the table cannot serve (not ascending, two entries in one bucket) is refused; NULL is an
// invalid argument.
static void test_q8_table(void) {
    static uint32_t tab[MN_Q8_TAB];
    float maps[2][256], bad[256], xs[16];
    int m, k, j, bad_n = 0, total = 0;
    mn_dynamic_map(1, maps[0]), mn_dynamic_map(0, maps[1]);
    for (m = 0; m < 2; m++) {
        const float *map = maps[m];
        CHECK(mn_q8_table(map, tab) == MN_OK);
        for (k = 0; k < 400000; k++) {
            int nx = 1;
            if (k < 256 * 4) {  // entry k/4 and its neighbours, the midpoint above and its neighbours
                int e = k / 4;
                float mid = e < 255 ? map[e] + (map[e + 1] - map[e]) / 2.0f : 2.0f;
                switch (k % 4) {
                case 0: xs[0] = map[e], xs[1] = nextafterf(map[e], -INFINITY);
                    xs[2] = nextafterf(map[e], INFINITY), nx = 3; break;
                case 1: xs[0] = mid, xs[1] = nextafterf(mid, -INFINITY);
                    xs[2] = nextafterf(mid, INFINITY), nx = 3; break;
                case 2: xs[0] = 0.0f, xs[1] = -0.0f, xs[2] = INFINITY, xs[3] = -INFINITY;
                    xs[4] = NAN, xs[5] = 1e-40f, xs[6] = -1e-40f, xs[7] = FLT_MAX;
                    xs[8] = -FLT_MAX, xs[9] = 1.0f, xs[10] = -1.0f, nx = 11; break;
                default: xs[0] = (float)(3.0 * mnt_rand_uniform() - 1.5); break;
                }
            } else if (k % 2) {
                xs[0] = (float)(3.0 * mnt_rand_uniform() - 1.5);
            } else {
                uint32_t u = (uint32_t)mnt_rand_u64();
                memcpy(&xs[0], &u, sizeof u);
            }
            for (j = 0; j < nx; j++) {
                uint32_t got = mn_hd_q8_nearest_tab(tab, xs[j]), want = mn_hd_q8_nearest(map, xs[j]);
                float a = xs[j] == 0.0f ? xs[j] : fabsf(xs[j]);  // -0 and NaN as they are
                total++;
                if (got != want && bad_n++ < 5)
                    CHECK_MSG(0, "map %d, x %.9g: table %u, search %u", m, (double)xs[j], got, want);
                if (m == 0) continue;
                // the unsigned map's upper half alone, for values not below 0
                got = mn_hd_q8_nearest_tab_pos(tab + MN_Q8_TAB / 2, a);
                want = mn_hd_q8_nearest(map, a);
                total++;
                if (got != want && bad_n++ < 5)
                    CHECK_MSG(0, "map 1, x %.9g: upper half %u, search %u", (double)a, got, want);
            }
        }
    }
    CHECK_MSG(bad_n == 0, "%d of %d lookups differ", bad_n, total);
    memcpy(bad, maps[1], sizeof bad);
    bad[10] = bad[12];  // not ascending
    CHECK(mn_q8_table(bad, tab) == MN_ERR_UNSUPPORTED);
    for (k = 0; k < 256; k++) bad[k] = 1.0f + (float)k * 1e-6f;  // many thresholds a bucket
    CHECK(mn_q8_table(bad, tab) == MN_ERR_UNSUPPORTED);
    CHECK(mn_q8_table(NULL, tab) == MN_ERR_INVALID_ARG && mn_q8_table(maps[0], NULL) == MN_ERR_INVALID_ARG);
}

// The fused found-inf / unscale / clip of the AdamW kernel against the host sequence
// mn_unscale_grads_to_fp32 -> mn_clip_grad_norm -> mn_adamw_step on loss-scaled gradients.
static void test_adamw_scaled(void) {
    uint64_t n = 517, dims[1], i;
    mn_adamw s;
    mn_adamw_params p;
    float *param = mnt_fvec(n), *g_scaled = mnt_fvec(n), *g = mnt_fvec(n), *hp = mnt_fvec(n);
    float *hm = mnt_fvec(n), *hv = mnt_fvec(n), inv_scale = 1.0f / 1024.0f, max_norm = 1.0f;
    float norm_host, norm_dev, clip;
    double acc = 0.0;
    int found_inf = 0;
    float *gp[1];
    uint64_t sz[1];
    mn_hd_adamw_coef k;
    dims[0] = n;
    memset(&p, 0, sizeof p);
    CHECK_OK(mn_adamw_init(&s, dims, 1, &p, NULL));
    mnt_fill_normal(param, n, 1.0);
    mnt_fill_normal(g_scaled, n, 1024.0);
    memcpy(hp, param, n * sizeof *hp);
    // host
    CHECK_OK(mn_unscale_grads_to_fp32(MN_FP32, g_scaled, g, n, inv_scale, &found_inf));
    CHECK(found_inf == 0);
    gp[0] = g, sz[0] = n;
    CHECK_OK(mn_clip_grad_norm(gp, sz, 1, max_norm, 2.0f, &norm_host));
    CHECK_OK(mn_adamw_step(&s, param, g, NULL));
    // the kernel: the norm of the scaled gradients (mn_cuda_global_norm), unscaled by inv_scale
    for (i = 0; i < n; i++) acc += (double)(g_scaled[i] * g_scaled[i]);
    norm_dev = (float)sqrt(acc);
    CHECK(mn_hd_isfinite(norm_dev));
    CHECK_NEAR(norm_dev * inv_scale, norm_host, 0.0, 1e-5);
    clip = mn_hd_clip_coef(norm_dev * inv_scale, max_norm);
    CHECK(clip < 1.0f);
    k = mn_hd_adamw_coefs(s.params.lr, s.params.beta1, s.params.beta2, s.params.eps,
                          s.params.weight_decay, 0, 1);
    for (i = 0; i < n; i++) mn_hd_adamw(hp + i, hm + i, hv + i, g_scaled[i] * inv_scale, clip, &k);
    {
        double *w = widen(param, n);
        CHECK_CLOSE("adamw scaled+clipped param", hp, w, n, 1e-7, 1e-5);
        free(w);
    }
    // found inf: a non-finite norm skips the step; no clipping when max_norm is 0
    CHECK(!mn_hd_isfinite((float)INFINITY));
    CHECK(!mn_hd_isfinite((float)NAN));
    CHECK(mn_hd_clip_coef(123.0f, 0.0f) == 1.0f);
    CHECK(mn_hd_clip_coef(0.5f, 1.0f) == 1.0f);
    mn_adamw_free(&s);
    free(param), free(g_scaled), free(g), free(hp), free(hm), free(hv);
}

// mn_hd_sgd against mn_sgd_step over 5 steps in every mode (plain; momentum with dampening and
// weight decay; nesterov; maximize): the same fp32 operations in the same order, so the host
// results are bit-for-bit equal (on the device a contracted multiply-add may move one ulp).
// The loss-scaled form (gradients x 256, grad_scale 1/256: exact powers of two) is bit-equal too.
static void test_sgd(void) {
    static const struct {
        float momentum, dampening, weight_decay;
        int nesterov, maximize;
    } modes[] = {{0, 0, 0, 0, 0}, {0, 0, 0.01f, 0, 1}, {0.9f, 0.1f, 0.01f, 0, 0},
                 {0.9f, 0, 0.05f, 1, 0}, {0.5f, 0, 0, 1, 1}};
    uint64_t n = 1003, dims[1], i, t;
    size_t m;
    float *param = mnt_fvec(n), *grad = mnt_fvec(n), *hp = mnt_fvec(n), *hb = mnt_fvec(n);
    uint16_t *p16 = (uint16_t *)calloc(n, sizeof(uint16_t));
    if (!p16) abort();
    dims[0] = n;
    for (m = 0; m < sizeof modes / sizeof modes[0]; m++) {
        mn_sgd s;
        mn_sgd_params p;
        memset(&p, 0, sizeof p);
        p.lr = 1e-2f, p.momentum = modes[m].momentum ? modes[m].momentum : MN_OPTIM_ZERO;
        p.dampening = modes[m].dampening, p.weight_decay = modes[m].weight_decay;
        p.nesterov = modes[m].nesterov, p.maximize = modes[m].maximize, p.dtype = MN_FP16;
        CHECK_OK(mn_sgd_init(&s, dims, 1, &p, NULL));
        mnt_fill_normal(param, n, 1.0);
        memcpy(hp, param, n * sizeof *hp);
        for (i = 0; i < n; i++) hb[i] = (float)NAN;  // step 1 must overwrite the buffer
        for (t = 1; t <= 5; t++) {
            mn_hd_sgd_coef k;
            k.lr = s.params.lr, k.momentum = s.params.momentum, k.dampening = s.params.dampening;
            k.weight_decay = s.params.weight_decay, k.nesterov = s.params.nesterov;
            k.maximize = s.params.maximize, k.first = t == 1;
            mnt_fill_normal(grad, n, 1.0);
            CHECK_OK(mn_sgd_step(&s, param, grad, p16));
            for (i = 0; i < n; i++)
                mn_hd_sgd(hp + i, s.momentum_buffer ? hb + i : NULL,
                          t % 2 ? grad[i] : grad[i] * 256.0f, t % 2 ? 1.0f : 1.0f / 256.0f, &k);
        }
        CHECK(memcmp(hp, param, n * sizeof *hp) == 0);
        if (s.momentum_buffer) CHECK(memcmp(hb, s.momentum_buffer, n * sizeof *hb) == 0);
        for (i = 0; i < n; i++) CHECK(p16[i] == mn_fp32_to_fp16(param[i]));
        mn_sgd_free(&s);
    }
    free(param), free(grad), free(hp), free(hb), free(p16);
}

// mn_hd_lion against mn_lion_step over 5 steps (with and without weight decay, default and
// custom betas): bit-for-bit on the host; sign(0) = 0 checked on its own.
static void test_lion(void) {
    uint64_t n = 1003, dims[1], i, t;
    int mode;
    float *param = mnt_fvec(n), *grad = mnt_fvec(n), *hp = mnt_fvec(n), *hm = mnt_fvec(n);
    uint16_t *p16 = (uint16_t *)calloc(n, sizeof(uint16_t));
    if (!p16) abort();
    dims[0] = n;
    for (mode = 0; mode < 2; mode++) {
        mn_lion s;
        mn_lion_params p;
        mn_hd_lion_coef k;
        memset(&p, 0, sizeof p);
        if (mode) p.lr = 3e-4f, p.beta1 = 0.95f, p.beta2 = 0.98f, p.weight_decay = 0.1f;
        p.dtype = MN_BF16;
        CHECK_OK(mn_lion_init(&s, dims, 1, &p, NULL));
        k = mn_hd_lion_coefs(s.params.lr, s.params.beta1, s.params.beta2, s.params.weight_decay);
        mnt_fill_normal(param, n, 1.0);
        memcpy(hp, param, n * sizeof *hp);
        memset(hm, 0, n * sizeof *hm);
        for (t = 1; t <= 5; t++) {
            mnt_fill_normal(grad, n, 1.0);
            if (t == 1) grad[0] = 0.0f;  // c = 0 at the first step: no update but the decay
            CHECK_OK(mn_lion_step(&s, param, grad, p16));
            for (i = 0; i < n; i++)
                mn_hd_lion(hp + i, hm + i, t % 2 ? grad[i] : grad[i] * 256.0f,
                           t % 2 ? 1.0f : 1.0f / 256.0f, &k);
            if (t == 1) CHECK(hp[0] == (float)(param[0]));
        }
        CHECK(memcmp(hp, param, n * sizeof *hp) == 0);
        CHECK(memcmp(hm, s.exp_avg, n * sizeof *hm) == 0);
        for (i = 0; i < n; i++) CHECK(p16[i] == mn_fp32_to_bf16(param[i]));
        mn_lion_free(&s);
    }
    {  // sign(0) = 0: a zero gradient on zero momentum moves the parameter by the decay only
        mn_hd_lion_coef k = mn_hd_lion_coefs(1e-2f, 0.9f, 0.99f, 0.0f);
        float p0 = 1.5f, m0 = 0.0f;
        mn_hd_lion(&p0, &m0, 0.0f, 1.0f, &k);
        CHECK(p0 == 1.5f && m0 == 0.0f);
    }
    free(param), free(grad), free(hp), free(hm), free(p16);
}

// The device's Adafactor sequence (alpha from RMS(p), the row and column means, mean(R), the
// update's RMS, the update; every sum in double) written with the mn_hd_adafactor_* functions,
// against mn_adafactor_step over 5 steps: factored ([3,5,37], [64,96]) and not ([1003]);
// relative step, fixed lr with beta1 and weight decay, no_scale_parameter with warmup_init.
// The host sums run in the host step's order (16 double lanes by column, lane l taking the
// columns j % 16 == l row after row, added by a fixed tree: mnt_lanes_total; these tensors are
// one piece of the host's sums, at most 65536 elements, so the terms go in one sequence), so the
// results are bit-for-bit equal; the device adds the same terms in another order (within 1e-5 on
// the GPU test). One exception: the host sums the factored u² as mean(R) Σ_j (Σ_i g² / R_i) / C_j
// (exact u, no float rounding of each u), so the device's clip_div, from the float u's, may sit
// an ulp away; it is checked to the ulp, and the host's taken for the rest.

static void test_adafactor(void) {
    static const uint64_t shapes[][3] = {{3, 5, 37}, {1, 64, 96}, {1, 1, 1003}};
    uint64_t sh, b, i, j, e, t;
    int mode;
    for (sh = 0; sh < 3; sh++)
        for (mode = 0; mode < 3; mode++) {
            uint64_t B = shapes[sh][0], R = shapes[sh][1], Cc = shapes[sh][2], n = B * R * Cc;
            uint64_t dims[3];
            uint32_t ndim;
            int factored = sh < 2;
            mn_adafactor s;
            mn_adafactor_params p;
            float *param = mnt_fvec(n), *grad = mnt_fvec(n), *hp = mnt_fvec(n), *hm = mnt_fvec(n);
            float *hv = mnt_fvec(n), *hr = mnt_fvec(B * R), *hc = mnt_fvec(B * Cc);
            float *rmean = mnt_fvec(B);
            if (sh == 0) dims[0] = B, dims[1] = R, dims[2] = Cc, ndim = 3;
            else if (sh == 1) dims[0] = R, dims[1] = Cc, ndim = 2;
            else dims[0] = n, ndim = 1;
            memset(&p, 0, sizeof p);
            if (mode == 1) p.lr = 1e-2f, p.beta1 = 0.9f, p.weight_decay = 0.01f;
            if (mode == 2) p.no_scale_parameter = 1, p.warmup_init = 1, p.clip_threshold = 0.5f;
            CHECK_OK(mn_adafactor_init(&s, dims, ndim, &p, NULL));
            mnt_fill_normal(param, n, 1.0);
            memcpy(hp, param, n * sizeof *hp);
            for (t = 1; t <= 5; t++) {
                const mn_adafactor_params *q = &s.params;
                mn_hd_adafactor_coef k = mn_hd_adafactor_coefs(
                    q->lr, q->eps1, q->eps2, q->decay_rate, q->beta1, q->weight_decay,
                    q->no_scale_parameter, q->warmup_init, t);
                double sum = 0.0, lane[16] = {0};
                float alpha, clip_div;
                mnt_fill_normal(grad, n, t == 3 ? 1e-3 : 1.0);
                CHECK_OK(mn_adafactor_step(&s, param, grad, NULL));
                for (e = 0; e < n; e++) lane[e % Cc % 16] += (double)hp[e] * hp[e];
                alpha = mn_hd_adafactor_alpha(&k, (float)sqrt(mnt_lanes_total(lane) / (double)n));
                CHECK(alpha == s.alpha);
                if (factored) {
                    for (i = 0; i < B * R; i++) {
                        memset(lane, 0, sizeof lane);
                        for (j = 0; j < Cc; j++)
                            lane[j % 16] += (double)(grad[i * Cc + j] * grad[i * Cc + j] + k.eps1);
                        hr[i] = mn_hd_adafactor_moment(hr[i], mnt_lanes_total(lane), Cc, &k);
                    }
                    for (b = 0; b < B; b++)
                        for (j = 0; j < Cc; j++) {
                            for (sum = 0.0, i = 0; i < R; i++) {
                                float g = grad[(b * R + i) * Cc + j];
                                sum += (double)(g * g + k.eps1);
                            }
                            hc[b * Cc + j] = mn_hd_adafactor_moment(hc[b * Cc + j], sum, R, &k);
                        }
                    for (b = 0; b < B; b++) {
                        for (sum = 0.0, i = 0; i < R; i++) sum += hr[b * R + i];
                        rmean[b] = (float)(sum / (double)R);
                    }
                } else {
                    for (e = 0; e < n; e++)
                        hv[e] = mn_hd_adafactor_moment(hv[e], (double)(grad[e] * grad[e] + k.eps1),
                                                       1, &k);
                }
                for (memset(lane, 0, sizeof lane), e = 0; e < n; e++) {
                    float u = factored ? mn_hd_adafactor_u(grad[e], hr[e / Cc], rmean[e / Cc / R],
                                                           hc[e / Cc / R * Cc + e % Cc])
                                       : mn_hd_adafactor_u_vec(grad[e], hv[e]);
                    lane[e % Cc % 16] += (double)u * u;
                }
                clip_div = mn_hd_adafactor_clip_div(mnt_lanes_total(lane), n, q->clip_threshold);
                CHECK_NEAR(clip_div, s.clip_div, 0, 1.2e-7);  // an ulp of the float (2^-23)
                clip_div = s.clip_div;  // (the rest the same bits)
                for (e = 0; e < n; e++) {
                    float u = factored ? mn_hd_adafactor_u(grad[e], hr[e / Cc], rmean[e / Cc / R],
                                                           hc[e / Cc / R * Cc + e % Cc])
                                       : mn_hd_adafactor_u_vec(grad[e], hv[e]);
                    mn_hd_adafactor_apply(hp + e, s.exp_avg ? hm + e : NULL, u, clip_div, alpha,
                                          &k);
                }
            }
            CHECK(memcmp(hp, param, n * sizeof *hp) == 0);
            if (factored) {
                CHECK(memcmp(hr, s.exp_avg_sq_row, B * R * sizeof *hr) == 0);
                CHECK(memcmp(hc, s.exp_avg_sq_col, B * Cc * sizeof *hc) == 0);
            } else {
                CHECK(memcmp(hv, s.exp_avg_sq, n * sizeof *hv) == 0);
            }
            if (s.exp_avg) CHECK(memcmp(hm, s.exp_avg, n * sizeof *hm) == 0);
            mn_adafactor_free(&s);
            free(param), free(grad), free(hp), free(hm), free(hv), free(hr), free(hc), free(rmean);
        }
}

const mnt_case test_cudamath_cases[] = {
    {"gelu", test_gelu},
    {"gelu_fast", test_gelu_fast},
    {"exp_fma", test_exp_fma},
    {"layernorm", test_layernorm},
    {"softmax", test_softmax},
    {"softmax_pairs", test_softmax_pairs},
    {"crossentropy", test_crossentropy},
    {"head_index", test_head_index},
    {"attention", test_attention},
    {"attention_blocks", test_attention_blocks},
    {"attention_scratch", test_attention_scratch},
    {"adamw", test_adamw},
    {"adamw_scaled", test_adamw_scaled},
    {"adamw8bit", test_adamw8bit},
    {"q8_codes", test_q8_codes},
    {"q8_table", test_q8_table},
    {"sgd", test_sgd},
    {"lion", test_lion},
    {"adafactor", test_adafactor},
};
const size_t test_cudamath_count = sizeof test_cudamath_cases / sizeof test_cudamath_cases[0];
