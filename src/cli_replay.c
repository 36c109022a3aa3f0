// `memanat replay`: part of memanat.c (included by it).
static int mn_cli_replay(int argc, char **argv) {
    (void)argc, (void)argv;
    fprintf(stderr, "memanat replay: not available in this build\n");
    return 2;
}
