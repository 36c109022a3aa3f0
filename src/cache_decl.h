// >>cache (decl) -- fragment of memanat.h
