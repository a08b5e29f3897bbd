"""Text handling shared by the router and the engine, without torch: tokenizer loading (GGUF
metadata or tokenizer.json), the chat template, the incremental detokenizer and request errors.

`open_model_text(path)` reads only what text needs from a checkpoint (its config, tokenizer and
model id), so a router pod needs neither torch nor the weights in memory.
"""
