// >>cache (impl) -- fragment of memanat.h
