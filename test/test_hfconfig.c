// Tests of the hfconfig section.
#include <string.h>
#include "harness.h"
#include "../memanat.h"

const mnt_case test_hfconfig_cases[] = {
    {NULL, NULL},
};
const size_t test_hfconfig_count = 0;
