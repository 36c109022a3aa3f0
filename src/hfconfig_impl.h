// >>hfconfig (impl) -- fragment of memanat.h
