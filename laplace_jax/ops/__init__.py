"""The kernels: chunked and single-step simple GLA, attention and its sliding window, the short causal
convolution, packed-document segments and context parallelism. They import only the root (platform, sharding)."""
