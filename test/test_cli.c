// Tests of the cli section.
#include <string.h>
#include "harness.h"
#include "../memanat.h"

const mnt_case test_cli_cases[] = {
    {NULL, NULL},
};
const size_t test_cli_count = 0;
