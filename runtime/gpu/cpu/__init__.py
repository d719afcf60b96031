"""The CPU side of the expert store: the C expert kernel, its per-ISA builds, and the lane that runs it for the GPU."""
