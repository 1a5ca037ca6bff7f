"""Untrusted container structure, read in one place: sniffing, zip directories, protobuf wire format,
GGUF headers, pickle opcodes, torch.save/TorchScript/PT2 archives, HDF5/JSON headers and the rules for member and external-data paths.

Every function here bounds-checks lengths, counts and offsets against the bytes it was given
before allocating anything, and raises only modelkit's errors. The scanner and every converter
read untrusted bytes through this package; there is no second parser of the same structure.
Imports only the standard library (and numpy where noted), never torch, so `modelkit scan` starts fast.
"""
