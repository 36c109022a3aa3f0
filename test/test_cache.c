// Tests of the cache section.
#include <string.h>
#include "harness.h"
#include "../memanat.h"

const mnt_case test_cache_cases[] = {
    {NULL, NULL},
};
const size_t test_cache_count = 0;
