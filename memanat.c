#include <stdio.h>
int main(void){puts("memanat CLI: not yet");return 0;}
