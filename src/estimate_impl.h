// >>estimate (impl) -- fragment of memanat.h
