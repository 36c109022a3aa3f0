# memanat: `make` builds the CLI, `make test` runs every test that needs no GPU.
# Other targets: sanitize (ASan+UBSan tests), cxx (header as C++), clang (warnings-as-errors
# under clang, also with MEMANAT_STATIC and the trainer, and the ops with MEMANAT_NO_SIMD), fuzz
# (bounded fuzzing of every parser), bench (benchmark programs), cuda-probe.
# With nvcc (found on PATH or in /usr/local/cuda/bin): `make` also builds build/memanat_cuda.o
# (sm_80 and sm_90, warnings as errors, `ptxas -v` in build/ptxas.log) and `make test` first runs
# build/test_cuda (the GPU tests; one SKIP line without a device). `make gpu-bench` builds the GPU
# benchmark; bench/gpu.sh runs everything on a GPU machine.

CC      ?= cc
CXX     ?= c++
CLANG   ?= clang
OPT     ?= -O2
WARN    := -Wall -Wextra -Wpedantic -Werror
CFLAGS  ?= $(OPT) -g
CSTD    := -std=c99
LDLIBS  := -lm -lpthread
HDRS    := memanat.h
# test/test_cuda.c is a program of its own (the GPU tests), linked with the CUDA backend.
TESTSRC := test/main.c $(filter-out test/test_cuda.c,$(wildcard test/test_*.c))
BENCHES := $(patsubst bench/%.c,build/%,$(wildcard bench/*.c))

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

.PHONY: all test sanitize cxx clang fuzz bench gpu-bench cuda-probe check clean

all: memanat trainer cuda-probe $(CUDA_OBJ)

memanat: memanat.c $(HDRS)
	$(CC) $(CSTD) $(CFLAGS) $(WARN) $(OPENMP) -o $@ memanat.c $(LDLIBS)

# The tiny GPT trainer (test/test_trainer.c includes trainer.c with TRAINER_TESTING). Built for
# this machine's CPU: the matmuls that are most of a step run about 3x faster with its vector
# units (AVX2/AVX-512) than with the baseline SSE2; TRAINER_OPT=-O2 builds a portable binary.
TRAINER_OPT ?= -O3 -march=native
trainer: trainer.c $(HDRS)
	$(CC) $(CSTD) $(TRAINER_OPT) -g $(WARN) $(OPENMP) -o $@ trainer.c $(LDLIBS)

build:
	@mkdir -p build

build/test_all: $(TESTSRC) test/harness.h $(HDRS) trainer.c | build
	$(CC) $(CSTD) $(CFLAGS) $(WARN) $(OPENMP) -o $@ $(TESTSRC) $(LDLIBS)

test: memanat build/test_all $(CUDA_TEST)
	@if [ -n "$(CUDA_TEST)" ]; then ./$(CUDA_TEST); fi
	./build/test_all

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

build/test_asan: $(TESTSRC) test/harness.h $(HDRS) trainer.c | build
	$(CC) $(CSTD) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -fno-omit-frame-pointer $(WARN) -o $@ $(TESTSRC) $(LDLIBS)

build/memanat_asan: memanat.c $(HDRS) | build
	$(CC) $(CSTD) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -fno-omit-frame-pointer $(WARN) -o $@ memanat.c $(LDLIBS)

# The library's argument checks do not lean on assert: the bad-argument tests also run with
# NDEBUG, where an assert would be gone.
build/test_asan_ndebug: $(TESTSRC) test/harness.h $(HDRS) trainer.c | build
	$(CC) $(CSTD) -O1 -g -DNDEBUG -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -fno-omit-frame-pointer $(WARN) -o $@ $(TESTSRC) $(LDLIBS)

sanitize: build/memanat_asan build/test_asan build/test_asan_ndebug
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ./build/test_asan_ndebug \
	    bad_arguments | tail -n 1
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 MEMANAT_BIN=build/memanat_asan \
	    ./build/test_asan

# The header compiles as C++ (nvcc compiles the CUDA backend as C++).
cxx: test/cxx_check.cpp $(HDRS) | build
	$(CXX) -std=c++11 $(OPT) $(WARN) -o build/cxx_check test/cxx_check.cpp $(LDLIBS)
	./build/cxx_check

clang: $(TESTSRC) $(HDRS) memanat.c trainer.c | build
	$(CLANG) $(CSTD) $(OPT) $(WARN) -o build/test_clang $(TESTSRC) $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -o build/memanat_clang memanat.c $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -DMEMANAT_STATIC -o build/memanat_static memanat.c $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -o build/trainer_clang trainer.c $(LDLIBS)
	MEMANAT_BIN=build/memanat_clang ./build/test_clang > build/test_clang.log || \
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

bench: $(BENCHES)

build/%: bench/%.c bench/bench.h $(HDRS) | build
	$(CC) $(CSTD) -O3 -march=native -g $(WARN) $(OPENMP) -o $@ $< $(LDLIBS)

build/bench_trainer: trainer.c  # includes the trainer

cuda-probe:
	@if [ -n "$(NVCC)" ]; then echo "cuda-probe: nvcc found: $(NVCC) ($$($(NVCC) --version | tail -n 2 | head -n 1))"; \
	else echo "cuda-probe: nvcc not found; the CUDA backend is not built"; fi

check: test sanitize cxx clang fuzz

clean:
	rm -rf build memanat trainer
