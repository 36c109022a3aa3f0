// Tests of the estimate section.
#include <string.h>
#include "harness.h"
#include "../memanat.h"

const mnt_case test_estimate_cases[] = {
    {NULL, NULL},
};
const size_t test_estimate_count = 0;
