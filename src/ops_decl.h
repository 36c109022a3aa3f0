// >>ops (decl) -- fragment of memanat.h
