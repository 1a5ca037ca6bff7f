"""How bytes reach the disk and come back: atomic outputs, mmap views and file-to-file copies,
zip records, dtypes, and the documented layouts of quantized tensors."""
