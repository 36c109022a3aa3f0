// >>json (impl) -- fragment of memanat.h
