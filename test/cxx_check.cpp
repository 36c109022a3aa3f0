// The header compiles as C++ (the CUDA backend is compiled by nvcc as C++).
#define MEMANAT_IMPLEMENTATION
#define MEMANAT_CUDA  // the CUDA API declarations compile as C++ too (nothing of it is called)
#include "../memanat.h"
#include <cstdio>

int main() {
    uint64_t v = 0;
    if (mn_size_parse("2GiB", &v) != MN_OK || v != (2ull << 30)) return 1;
    std::printf("memanat.h compiles and runs as C++ (%s)\n", MEMANAT_VERSION);
    return 0;
}
