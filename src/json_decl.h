// >>json (decl) -- fragment of memanat.h
