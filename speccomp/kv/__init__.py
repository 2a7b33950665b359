"""KV-cache compression: policies, compressed caches, the lossless draft mode and the LOSSY target mode."""
