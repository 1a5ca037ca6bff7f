"""The work the commands do, each as plan -> transform -> write -> verify: convert, quantize,
compress (prune, distill), train; every output goes through one write-and-verify path."""
