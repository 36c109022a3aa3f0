// Tests of the ops section.
#include <string.h>
#include "harness.h"
#include "../memanat.h"

const mnt_case test_ops_cases[] = {
    {NULL, NULL},
};
const size_t test_ops_count = 0;
