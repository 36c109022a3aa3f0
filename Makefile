# memanat: `make` builds the CLI, `make test` runs every test that needs no GPU.
# Other targets: sanitize (ASan+UBSan tests), cxx (header as C++), clang (warnings-as-errors
# under clang, also with MEMANAT_STATIC and the trainer, and the ops with MEMANAT_NO_SIMD), fuzz (bounded
# fuzzing of the parsers), bench (benchmark programs), cuda-probe.

CC      ?= cc
CXX     ?= c++
CLANG   ?= clang
OPT     ?= -O2
WARN    := -Wall -Wextra -Wpedantic -Werror
CFLAGS  ?= $(OPT) -g
CSTD    := -std=c99
LDLIBS  := -lm -lpthread
HDRS    := memanat.h
TESTSRC := test/main.c $(wildcard test/test_*.c)
BENCHES := $(patsubst bench/%.c,build/%,$(wildcard bench/*.c))

# OpenMP when the compiler has it (the reference ops use it; the build works without it).
OPENMP  := $(shell echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
NVCC    := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)

.PHONY: all test sanitize cxx clang fuzz bench cuda-probe check clean

all: memanat trainer cuda-probe

memanat: memanat.c $(HDRS)
	$(CC) $(CSTD) $(CFLAGS) $(WARN) $(OPENMP) -o $@ memanat.c $(LDLIBS)

# The tiny GPT trainer (test/test_trainer.c includes trainer.c with TRAINER_TESTING).
trainer: trainer.c $(HDRS)
	$(CC) $(CSTD) $(CFLAGS) $(WARN) $(OPENMP) -o $@ trainer.c $(LDLIBS)

build:
	@mkdir -p build

build/test_all: $(TESTSRC) test/harness.h $(HDRS) trainer.c | build
	$(CC) $(CSTD) $(CFLAGS) $(WARN) $(OPENMP) -o $@ $(TESTSRC) $(LDLIBS)

test: memanat build/test_all
	./build/test_all

build/test_asan: $(TESTSRC) test/harness.h $(HDRS) trainer.c | build
	$(CC) $(CSTD) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -fno-omit-frame-pointer $(WARN) -o $@ $(TESTSRC) $(LDLIBS)

build/memanat_asan: memanat.c $(HDRS) | build
	$(CC) $(CSTD) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -fno-omit-frame-pointer $(WARN) -o $@ memanat.c $(LDLIBS)

sanitize: build/memanat_asan build/test_asan
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 MEMANAT_BIN=build/memanat_asan ./build/test_asan

# The header compiles as C++ (nvcc compiles the CUDA backend as C++).
cxx: test/cxx_check.cpp $(HDRS) | build
	$(CXX) -std=c++11 $(OPT) $(WARN) -o build/cxx_check test/cxx_check.cpp $(LDLIBS)
	./build/cxx_check

clang: $(TESTSRC) $(HDRS) memanat.c trainer.c | build
	$(CLANG) $(CSTD) $(OPT) $(WARN) -o build/test_clang $(TESTSRC) $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -o build/memanat_clang memanat.c $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -DMEMANAT_STATIC -o build/memanat_static memanat.c $(LDLIBS)
	$(CLANG) $(CSTD) $(OPT) $(WARN) -o build/trainer_clang trainer.c $(LDLIBS)
	./build/test_clang > build/test_clang.log || (tail -n 30 build/test_clang.log; exit 1)
	@tail -n 1 build/test_clang.log
	$(CLANG) $(CSTD) $(OPT) $(WARN) -DMEMANAT_NO_SIMD -o build/test_nosimd $(TESTSRC) $(LDLIBS)
	./build/test_nosimd ops > build/test_nosimd.log || (tail -n 30 build/test_nosimd.log; exit 1)
	@echo "ops without SIMD: $$(tail -n 1 build/test_nosimd.log)"

# Fuzzing the JSON, safetensors and config readers for a bounded time (FUZZ_SECONDS).
FUZZ_SECONDS ?= 20
fuzz: test/fuzz.c $(HDRS) | build
	$(CC) $(CSTD) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined $(WARN) \
	    -o build/fuzz test/fuzz.c $(LDLIBS)
	./build/fuzz --seconds $(FUZZ_SECONDS) test/corpus

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
