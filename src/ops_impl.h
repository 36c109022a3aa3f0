// >>ops (impl) -- fragment of memanat.h
