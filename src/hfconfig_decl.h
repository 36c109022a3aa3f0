// >>hfconfig (decl) -- fragment of memanat.h
