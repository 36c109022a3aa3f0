// Tests of the optim section.
#include <string.h>
#include "harness.h"
#include "../memanat.h"

const mnt_case test_optim_cases[] = {
    {NULL, NULL},
};
const size_t test_optim_count = 0;
