// Speed of the estimator: one estimate (symbolic step alone, and with the allocator replay) and
// one fit, for models from 0.1B to 70B parameters. Prints medians of repeated runs.
//   make bench && ./build/bench_estimate
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MEMANAT_IMPLEMENTATION
#include "../memanat.h"
#include "bench.h"

static double now_us(void) { return bench_wall_ns() / 1e3; }

int main(void) {
    static const struct { const char *model, *gpu; mn_precision prec; uint64_t batch, seq; } cases[] = {
        {"bert-large-uncased", "v100-16gb", MN_PREC_FP32, 4, 512},
        {"gpt2-xl", "a100-40gb", MN_PREC_FP16, 8, 1024},
        {"llama-3-8b", "h100-80gb", MN_PREC_BF16, 2, 4096},
        {"llama-3-70b", "h100-80gb", MN_PREC_BF16, 1, 8192},
    };
    enum { REPS = 15 };
    char cpu[128];
    size_t c;
    bench_cpu_model(cpu, sizeof cpu);
    printf("memanat %s estimator speed on %s (medians of %d runs)\n\n", MEMANAT_VERSION, cpu, REPS);
    printf("%-20s %8s %10s %14s %14s %12s %8s\n", "model", "params", "events", "step only us", "with replay us",
           "fit ms", "fit runs");
    for (c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        mn_model m;
        mn_setup s;
        mn_estimate_result r;
        mn_fit_result f;
        double t_sim[REPS], t_rep[REPS], t_fit[5], t0;
        int i;
        memset(&s, 0, sizeof s);
        if (mn_preset_find(cases[c].model, &m) != MN_OK) return 1;
        s.gpu = cases[c].gpu, s.precision = cases[c].prec, s.batch = cases[c].batch, s.seq = cases[c].seq;
        for (i = 0; i < REPS; i++) {
            s.no_replay = 1;
            t0 = now_us();
            if (mn_estimate(&m, &s, &r) != MN_OK) return 1;
            t_sim[i] = now_us() - t0;
            s.no_replay = 0;
            t0 = now_us();
            if (mn_estimate(&m, &s, &r) != MN_OK) return 1;
            t_rep[i] = now_us() - t0;
        }
        for (i = 0; i < 5; i++) {
            t0 = now_us();
            if (mn_fit(&m, &s, &f) != MN_OK) return 1;
            t_fit[i] = (now_us() - t0) / 1e3;
        }
        printf("%-20s %7.2fB %10llu %14.0f %14.0f %12.1f %8llu\n", cases[c].model, (double)r.params / 1e9,
               (unsigned long long)r.alloc_events, bench_median(t_sim, REPS), bench_median(t_rep, REPS), bench_median(t_fit, 5),
               (unsigned long long)f.estimates_run);
    }
    {  // growth: llama-3-70b's shape with the layer count and the sequence length scaled; one
       // estimate (with the allocator replay) and one fit, alternated, medians
        static const uint64_t layers[] = {8, 32, 80, 160}, seqs[] = {1024, 4096, 8192, 32768};
        mn_model m;
        mn_setup s;
        mn_estimate_result r;
        mn_fit_result f;
        double te[REPS], tf[5], t0;
        int i, k;
        printf("\ngrowth (llama-3-70b shape, bf16, h100-80gb, batch 1; seq 8192 or 80 layers)\n");
        printf("%-8s %6s %10s %12s %10s %8s\n", "", "", "events", "estimate ms", "fit ms",
               "fit runs");
        for (k = 0; k < 8; k++) {
            memset(&s, 0, sizeof s);
            if (mn_preset_find("llama-3-70b", &m) != MN_OK) return 1;
            s.gpu = "h100-80gb", s.precision = MN_PREC_BF16, s.batch = 1, s.seq = 8192;
            if (k < 4) m.layers = layers[k];
            else s.seq = seqs[k - 4];
            for (i = 0; i < REPS; i++) {
                t0 = now_us();
                if (mn_estimate(&m, &s, &r) != MN_OK) return 1;
                te[i] = (now_us() - t0) / 1e3;
                if (i >= 5) continue;
                t0 = now_us();
                if (mn_fit(&m, &s, &f) != MN_OK) return 1;
                tf[i] = (now_us() - t0) / 1e3;
            }
            printf("%-8s %6llu %10llu %12.2f %10.2f %8llu\n", k < 4 ? "layers" : "seq",
                   (unsigned long long)(k < 4 ? layers[k] : seqs[k - 4]),
                   (unsigned long long)r.alloc_events, bench_median(te, REPS),
                   bench_median(tf, 5), (unsigned long long)f.estimates_run);
        }
    }
    {  // fit's cost against one estimate's, as the layers and the sequence grow (no replay: the
       // search and the simulation alone); fit/est is the number of estimates it costs
        static const uint64_t layers[] = {80, 800, 8000}, seqs[] = {2048, 8192, 32768};
        mn_model m;
        mn_setup s;
        mn_estimate_result r;
        mn_fit_result f;
        double te[5], tf[5], t0;
        int i, k;
        printf("\nfit against estimate (llama-3-70b shape, bf16, h100-80gb, batch 1, --no-replay)\n");
        printf("%-8s %6s %12s %12s %8s %8s\n", "", "", "estimate ms", "fit ms", "fit runs",
               "fit/est");
        for (k = 0; k < 6; k++) {
            memset(&s, 0, sizeof s);
            if (mn_preset_find("llama-3-70b", &m) != MN_OK) return 1;
            s.gpu = "h100-80gb", s.precision = MN_PREC_BF16, s.batch = 1, s.seq = 8192;
            s.no_replay = 1;
            if (k < 3) m.layers = layers[k];
            else s.seq = seqs[k - 3];
            for (i = 0; i < 5; i++) {  // alternated, medians
                t0 = now_us();
                if (mn_estimate(&m, &s, &r) != MN_OK) return 1;
                te[i] = (now_us() - t0) / 1e3;
                t0 = now_us();
                if (mn_fit(&m, &s, &f) != MN_OK) return 1;
                tf[i] = (now_us() - t0) / 1e3;
            }
            printf("%-8s %6llu %12.2f %12.2f %8llu %8.1f\n", k < 3 ? "layers" : "seq",
                   (unsigned long long)(k < 3 ? layers[k] : seqs[k - 3]),
                   bench_median(te, 5), bench_median(tf, 5),
                   (unsigned long long)f.estimates_run, bench_median(tf, 5) / bench_median(te, 5));
        }
    }
    return 0;
}
