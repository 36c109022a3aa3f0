# memanat: `make` builds the CLI, `make test` runs every test that needs no GPU.
# Other targets: sanitize (ASan+UBSan tests), cxx (header as C++), clang (warnings-as-errors
# under clang, the tests with the ops' requests ahead on whatever the CPU (MEMANAT_PREFETCH=1),
# also with MEMANAT_STATIC and the trainer, with and without its GPU path, the header as C++
# under clang++, and the ops with MEMANAT_NO_SIMD), fuzz (bounded fuzzing of every
# parser), bench (benchmark programs; bench_matmul beside OpenBLAS when it links), cblas-test (the
# ops tests with MEMANAT_CBLAS, against OpenBLAS), native (the ops and optimizer tests built for
# this CPU, so that its AVX2/AVX-512 paths run), cuda-probe.
# With nvcc (found on PATH or in /usr/local/cuda/bin): `make` also builds build/memanat_cuda.o
# (sm_80 and sm_90, warnings as errors, `ptxas -v` in build/ptxas.log) and links it into the
# trainer (--device cuda), and `make test` first runs
# build/test_cuda (the GPU tests; one SKIP line without a device). `make gpu-bench` builds the GPU
# benchmark; bench/gpu.sh runs everything on a GPU machine.
# The same header elsewhere: `make python` builds the Python package's wheel (build/wheel),
# `make web` the browser page (web/index.html: WebAssembly, clang's wasm32-wasi target). `make
# test` builds both when their tools are present, and its bindings suite runs their tests
# (python/tests with pytest; the page in headless Chromium), each one SKIP line without them.

CC      ?= cc
CXX     ?= c++
CLANG   ?= clang
CLANGXX ?= clang++
OPT     ?= -O2
WARN    := -Wall -Wextra -Wpedantic -Werror
CFLAGS  ?= $(OPT) -g
CSTD    := -std=c99
LDLIBS  := -lm -lpthread
HDRS    := memanat.h
# test/test_cuda.c is a program of its own (the GPU tests), linked with the CUDA backend.
TESTSRC := test/main.c $(filter-out test/test_cuda.c,$(wildcard test/test_*.c))
# bench/peer_*.c: peers linked into a benchmark (compiled with the peer's own flags), not programs.
BENCHES := $(patsubst bench/%.c,build/%,$(filter-out bench/peer_%.c,$(wildcard bench/*.c)))

# OpenMP when the compiler has it (the reference ops use it; the build works without it).
OPENMP  := $(shell echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
NVCC    := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)

# The CUDA backend: explicit architectures (the build machine may have no GPU, so never
# -arch=native); sm_90 also carries PTX for newer GPUs. Link with nvcc (static cudart) and the
# toolkit's cuBLASLt, found through an rpath.
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_LIB  := $(CUDA_HOME)/lib64
NVCCFLAGS ?= -O3
NVCCARCH  := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90]
NVCCWARN  := -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror
CUDA_LINK := -L$(CUDA_LIB) -lcublasLt -Xlinker -rpath,$(CUDA_LIB) -lm -lpthread
ifneq ($(NVCC),)
CUDA_OBJ  := build/memanat_cuda.o
CUDA_TEST := build/test_cuda
endif

.PHONY: all test sanitize cxx clang native fuzz bench gpu-bench cuda-probe check clean python python-ext \
        web web-probe fuzz-api cblas-test

all: memanat trainer cuda-probe $(CUDA_OBJ)

memanat: memanat.c $(HDRS)
	$(CC) $(CSTD) $(CFLAGS) $(WARN) $(OPENMP) -o $@ memanat.c $(LDLIBS)

# The tiny GPT trainer (test/test_trainer.c includes trainer.c with TRAINER_TESTING). Built for
# this machine's CPU: the matmuls that are most of a step run about 3x faster with its vector
# units (AVX2/AVX-512) than with the baseline SSE2; TRAINER_OPT=-O2 builds a portable binary.
TRAINER_OPT ?= -O3 -march=native
# With nvcc the trainer has the GPU path too (--device cuda): compiled with MEMANAT_CUDA by the C
# compiler, linked with memanat_cuda.o by nvcc. Without it, the plain C build.
ifneq ($(NVCC),)
trainer: trainer.c $(HDRS) build/memanat_cuda.o | build
	$(CC) $(CSTD) $(TRAINER_OPT) -g $(WARN) $(OPENMP) -DMEMANAT_CUDA -c -o build/trainer.o trainer.c
	$(NVCC) -o $@ build/trainer.o build/memanat_cuda.o $(CUDA_LINK) $(if $(OPENMP),-lgomp)
else
trainer: trainer.c $(HDRS)
	$(CC) $(CSTD) $(TRAINER_OPT) -g $(WARN) $(OPENMP) -o $@ trainer.c $(LDLIBS)
endif

build:
	@mkdir -p build

build/test_all: $(TESTSRC) test/harness.h test/cache_ref.h $(HDRS) trainer.c bind/memanat_api.c | build
	$(CC) $(CSTD) $(CFLAGS) $(WARN) $(OPENMP) -o $@ $(TESTSRC) $(LDLIBS)

test: memanat build/test_all $(CUDA_TEST) python-ext web-probe
	@if [ -n "$(CUDA_TEST)" ]; then ./$(CUDA_TEST); fi
	./build/test_all

# ---- Python and the browser: bind/memanat_api.c over the header, for each place -----------------

PYTHON  ?= python3
BIND    := bind/memanat_api.c bind/memanat_api.h $(HDRS)
PY_OK   := $(shell $(PYTHON) -c 'import os, sys, sysconfig, setuptools; \
    sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    2>/dev/null && echo yes)

# The extension built in place (python/memanat/_native*.so) for the tests.
python-ext:
ifeq ($(PY_OK),yes)
	@$(MAKE) --no-print-directory build/python-ext.stamp
else
	@echo "python-ext: $(PYTHON) with setuptools and Python.h not found; the Python tests skip"
endif

build/python-ext.stamp: $(BIND) python/setup.py python/memanat/_native.c | build
	cd python && $(PYTHON) setup.py -q build_ext --inplace > ../build/python-ext.log 2>&1 \
	    || { tail -n 20 ../build/python-ext.log; exit 1; }
	@touch $@

# A wheel for the stable ABI (one file serves CPython 3.9 and later) in build/wheel; built with
# the installed setuptools and wheel when both are there, else in pip's isolated environment.
python: | build
	cd python && if $(PYTHON) -c 'import setuptools, wheel' 2>/dev/null; then \
	    $(PYTHON) -m pip wheel -q --no-deps --no-build-isolation -w ../build/wheel .; \
	else $(PYTHON) -m pip wheel -q --no-deps -w ../build/wheel .; fi
	@ls -l build/wheel/*.whl

# The page: memanat_api.c for wasm32-wasi (a reactor exporting mn_api_call), inlined in base64
# into web/page.html, so that web/index.html works from the file system and any static host.
WASM_CC    ?= clang
WASM_FLAGS := --target=wasm32-wasi -O2 -std=c99 $(WARN) -DMEMANAT_NO_THREADS -mexec-model=reactor \
              -Wl,--strip-all $(foreach f,mn_api_call mn_api_free malloc free,-Wl,--export=$(f))
WASM_DEBIAN := apt-get install clang lld wasi-libc libclang-rt-14-dev-wasm32

web: web/index.html
	@echo "web: web/index.html ($$(wc -c < web/index.html) bytes), build/memanat.wasm \
	($$(wc -c < build/memanat.wasm) bytes)"

build/memanat.wasm: $(BIND) | build
	$(WASM_CC) $(WASM_FLAGS) -o $@ bind/memanat_api.c

web/index.html: web/page.html build/memanat.wasm
	base64 -w0 build/memanat.wasm > build/memanat.wasm.b64
	awk -v f=build/memanat.wasm.b64 'BEGIN { getline b < f } \
	    { i = index($$0, "@MEMANAT_WASM_BASE64@"); \
	      if (i) print substr($$0, 1, i - 1) b substr($$0, i + 21); else print }' \
	    web/page.html > $@.tmp && mv $@.tmp $@

# For `make test`: the page when clang can link for wasm32-wasi, else a line saying what to install.
web-probe: | build
	@if printf 'int f(void);\nint f(void) { return 0; }\n' > build/wasm_probe.c && \
	    $(WASM_CC) --target=wasm32-wasi -mexec-model=reactor -o build/wasm_probe.wasm \
	    build/wasm_probe.c >/dev/null 2>&1; then $(MAKE) --no-print-directory web; \
	else echo "web: $(WASM_CC) cannot link for wasm32-wasi; the page is not built ($(WASM_DEBIAN))"; fi

# ptxas -v (registers, spills, shared memory per kernel) goes to build/ptxas.log.
build/memanat_cuda.o: memanat_cuda.cu $(HDRS) | build
	$(NVCC) -std=c++14 $(NVCCFLAGS) $(NVCCARCH) $(NVCCWARN) -Xptxas -v -c -o $@ memanat_cuda.cu \
	    2> build/ptxas.log || { cat build/ptxas.log; exit 1; }
	@echo "memanat_cuda.o: $$(grep -c 'Compiling entry' build/ptxas.log) kernel builds, \
	$$(grep -c '[1-9][0-9]* bytes spill' build/ptxas.log) with spills (build/ptxas.log)"

build/test_cuda.o: test/test_cuda.c $(HDRS) | build
	$(CC) $(CSTD) $(CFLAGS) $(WARN) -c -o $@ test/test_cuda.c

build/test_cuda: build/test_cuda.o build/memanat_cuda.o
	$(NVCC) -o $@ build/test_cuda.o build/memanat_cuda.o $(CUDA_LINK)

build/memanat_impl.o: $(HDRS) | build
	printf '#define MEMANAT_IMPLEMENTATION\n#include "../memanat.h"\n' > build/memanat_impl.c
	$(CC) $(CSTD) $(CFLAGS) $(WARN) -c -o $@ build/memanat_impl.c

build/bench_gpu: bench/bench_gpu.cu build/memanat_cuda.o build/memanat_impl.o $(HDRS) | build
	$(NVCC) -std=c++14 -O3 $(NVCCARCH) $(NVCCWARN) -o $@ bench/bench_gpu.cu build/memanat_cuda.o \
	    build/memanat_impl.o $(CUDA_LINK)

gpu-bench: build/bench_gpu

build/test_asan: $(TESTSRC) test/harness.h test/cache_ref.h $(HDRS) trainer.c bind/memanat_api.c | build
	$(CC) $(CSTD) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -fno-omit-frame-pointer $(WARN) -o $@ $(TESTSRC) $(LDLIBS)

build/memanat_asan: memanat.c $(HDRS) | build
	$(CC) $(CSTD) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -fno-omit-frame-pointer $(WARN) -o $@ memanat.c $(LDLIBS)

# The library's argument checks do not lean on assert: the bad-argument tests also run with
# NDEBUG, where an assert would be gone.
build/test_asan_ndebug: $(TESTSRC) test/harness.h test/cache_ref.h $(HDRS) trainer.c | build
	$(CC) $(CSTD) -O1 -g -DNDEBUG -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -fno-omit-frame-pointer $(WARN) -o $@ $(TESTSRC) $(LDLIBS)

sanitize: build/memanat_asan build/test_asan build/test_asan_ndebug
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ./build/test_asan_ndebug \
	    bad_arguments | tail -n 1
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 MEMANAT_BIN=build/memanat_asan \
	    MN_TEST_NO_BINDINGS=1 ./build/test_asan

# The ops and optimizer tests built for this machine's CPU: the portable build above (-O2, no
# -march) runs the generic vector lanes, this one the AVX2/AVX-512 paths that the trainer and
# the benchmarks (built with -march=native) take.
native: $(TESTSRC) test/harness.h test/cache_ref.h $(HDRS) trainer.c bind/memanat_api.c | build
	$(CC) $(CSTD) -O2 -march=native -g $(WARN) $(OPENMP) -o build/test_native $(TESTSRC) $(LDLIBS)
	./build/test_native ops > build/test_native.log || (tail -n 30 build/test_native.log; exit 1)
	./build/test_native optim >> build/test_native.log || (tail -n 30 build/test_native.log; exit 1)
	@echo "ops and optimizers built for this CPU: $$(grep -c '^\[ OK \]' build/test_native.log) passed"

# The header compiles as C++ (nvcc compiles the CUDA backend as C++).
cxx: test/cxx_check.cpp $(HDRS) | build
	$(CXX) -std=c++11 $(OPT) $(WARN) -o build/cxx_check test/cxx_check.cpp $(LDLIBS)
	./build/cxx_check

clang: $(TESTSRC) $(HDRS) memanat.c trainer.c bind/memanat_api.c | build
	$(CLANG) $(CSTD) $(OPT) $(WARN) -DMEMANAT_PREFETCH=1 -o build/test_clang $(TESTSRC) $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -o build/memanat_clang memanat.c $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -DMEMANAT_STATIC -o build/memanat_static memanat.c $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -o build/trainer_clang trainer.c $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -DMEMANAT_CUDA -c -o build/trainer_cuda_clang.o trainer.c
	$(CLANGXX) -std=c++11 $(OPT) $(WARN) -o build/cxx_check_clang test/cxx_check.cpp $(LDLIBS)
	./build/cxx_check_clang
	MEMANAT_BIN=build/memanat_clang MN_TEST_NO_BINDINGS=1 ./build/test_clang > build/test_clang.log || \
	    (tail -n 30 build/test_clang.log; exit 1)
	@tail -n 1 build/test_clang.log
	$(CLANG) $(CSTD) $(OPT) $(WARN) -DMEMANAT_NO_SIMD -o build/test_nosimd $(TESTSRC) $(LDLIBS)
	./build/test_nosimd ops > build/test_nosimd.log || (tail -n 30 build/test_nosimd.log; exit 1)
	@echo "ops without SIMD: $$(tail -n 1 build/test_nosimd.log)"

# Fuzzing every parser (test/fuzz/fuzz.c: json, safetensors, config, index, snapshot, csv, lengths,
# allocconf, size), each for FUZZ_SECONDS from its seeds in test/fuzz/corpus/NAME;
# FUZZ_TARGET=NAME runs one.
FUZZ_SECONDS ?= 10
FUZZ_TARGET ?= all
build/fuzz: test/fuzz/fuzz.c memanat.c $(HDRS) | build
	$(CC) $(CSTD) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined $(WARN) \
	    -o $@ test/fuzz/fuzz.c $(LDLIBS)

fuzz: build/fuzz
	./build/fuzz --seconds $(FUZZ_SECONDS) --target $(FUZZ_TARGET) test/fuzz/corpus
	@$(MAKE) --no-print-directory fuzz-api

# The request reader of mn_api_call (bind/memanat_api.c), seeded from requests built in.
fuzz-api: test/fuzz/fuzz_api.c $(BIND) | build
	$(CC) $(CSTD) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined $(WARN) \
	    -DMEMANAT_NO_THREADS -o build/fuzz_api test/fuzz/fuzz_api.c $(LDLIBS)
	./build/fuzz_api --seconds $(FUZZ_SECONDS)

# `make bench` builds every benchmark and prints the table of build/bench_table (memanat beside a
# peer in the same run). OpenBLAS, when its header and library are installed, is the matmul peer
# (apt-get install libopenblas-dev); never required.

bench: $(BENCHES)
	./build/bench_table

# bench_matmul times OpenBLAS beside the header's matmul when cblas.h and -lopenblas are there
# (Debian: libopenblas-dev); BENCH_BLAS= builds it without a peer.
OPENBLAS_INC := $(firstword $(wildcard /usr/include/x86_64-linux-gnu/openblas-pthread \
                  /usr/include/openblas))
OPENBLAS_PROBE := '\043include <cblas.h>\nint main(void) { openblas_set_num_threads(1); }\n'
ifeq ($(origin BENCH_BLAS),undefined)
BENCH_BLAS := $(shell printf $(OPENBLAS_PROBE) | $(CC) -x c - -o /dev/null -lopenblas \
    $(if $(OPENBLAS_INC),-I$(OPENBLAS_INC)) 2>/dev/null && echo openblas)
endif
build/bench_matmul: BENCH_FLAGS := $(if $(BENCH_BLAS),-DBENCH_OPENBLAS \
    $(if $(OPENBLAS_INC),-I$(OPENBLAS_INC)),)
build/bench_matmul: BENCH_LIBS := $(if $(BENCH_BLAS),-lopenblas,)
TABLE_BLAS := $(if $(BENCH_BLAS),-DMN_BENCH_CBLAS $(if $(OPENBLAS_INC),-I$(OPENBLAS_INC)) -lopenblas)

# The matmuls through a CBLAS (MEMANAT_CBLAS): the ops tests built against OpenBLAS by default;
# CBLAS_FLAGS and CBLAS_LIBS name another (e.g. MKL). Not part of `make test`: no BLAS is needed.
CBLAS_FLAGS ?= $(if $(OPENBLAS_INC),-I$(OPENBLAS_INC))
CBLAS_LIBS  ?= -lopenblas
cblas-test: $(TESTSRC) test/harness.h test/cache_ref.h $(HDRS) trainer.c bind/memanat_api.c | build
	$(CC) $(CSTD) $(CFLAGS) $(WARN) $(OPENMP) -DMEMANAT_CBLAS $(CBLAS_FLAGS) -o build/test_cblas \
	    $(TESTSRC) $(CBLAS_LIBS) $(LDLIBS)
	./build/test_cblas ops

build/%: bench/%.c bench/bench.h $(HDRS) | build
	$(CC) $(CSTD) -O3 -march=native -g $(WARN) $(OPENMP) $(BENCH_FLAGS) -o $@ $< $(BENCH_LIBS) \
	    $(LDLIBS)

# The AdamW row's peer: llm.c's update loop built as llm.c builds it (-Ofast = -O3 -ffast-math).
build/peer_llmc_adamw.o: bench/peer_llmc_adamw.c | build
	$(CC) $(CSTD) -O3 -ffast-math -march=native -g $(WARN) -c -o $@ $<

build/bench_table: bench/bench_table.c bench/bench.h build/peer_llmc_adamw.o $(HDRS) | build
	$(CC) $(CSTD) -O3 -march=native -g $(WARN) $(OPENMP) -o $@ $< build/peer_llmc_adamw.o \
	    $(TABLE_BLAS) $(LDLIBS)

build/bench_trainer: trainer.c  # includes the trainer

cuda-probe:
	@if [ -n "$(NVCC)" ]; then echo "cuda-probe: nvcc found: $(NVCC) ($$($(NVCC) --version | tail -n 2 | head -n 1))"; \
	else echo "cuda-probe: nvcc not found; the CUDA backend is not built"; fi

check: test sanitize cxx clang fuzz

clean:
	rm -rf build memanat trainer web/index.html python/src python/build python/memanat/*.so
