// Tests of the json section.
#include <string.h>
#include "harness.h"
#include "../memanat.h"

const mnt_case test_json_cases[] = {
    {NULL, NULL},
};
const size_t test_json_count = 0;
