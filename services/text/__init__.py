"""Text handling shared by the router and the engine, without torch: tokenizer loading (GGUF
metadata or tokenizer.json), the chat template, the output processor (incremental detokenization
and stop strings, for the engine and the router alike) and request errors.

`open_model_text(path)` reads only what text needs from a checkpoint (its config, tokenizer and
model id), so a router pod needs neither torch nor the weights in memory.
"""
