"""Model building blocks, written tensor-parallel-ready (world size 1 unless distributed is set up)."""
