"""ocrvl's benchmark of record on a real GPU: `python -m bench.gpu --help`.

Kept import-light: vLLM's engine imports `bench.gpu.answer_lengths` from here.
"""
